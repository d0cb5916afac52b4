"""Run each strategy on the demo or the user's model in its own processes, then evaluate every result the same way in
this process.

Which strategies exist and can run here is :mod:`.catalogue`; how a strategy's processes start (forked from one
process that has imported torch and Lightning, where the platform allows) is :mod:`.launch`; what runs inside them
is :mod:`.worker`. Their names are importable from here as well.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torchmetrics.classification import MulticlassAccuracy

from lightning_dp_strategies.compare.catalogue import BASELINE, check_strategies, default_strategies, processes_for
from lightning_dp_strategies.compare.demo import DemoClassifier, DemoConfig, make_dataset
from lightning_dp_strategies.compare.forks import fork_server_available, shared_fork_server
from lightning_dp_strategies.compare.launch import Session, launch
from lightning_dp_strategies.compare.task import (
    Task,
    dump_task,
    first_global_batch,
    make_task,
    training_loss,
)
from lightning_dp_strategies.data_parallel.pytree import _tensors

WARMUP_STEPS = 3


@dataclass
class RunResult:
    """One row of the comparison (and its curves).

    ``status`` is ``"ok"``, ``"n/a"`` (the strategy cannot run this model or configuration; ``error`` says why in one
    line), ``"failed"`` (it started and then crashed) or ``"timeout"``.

    Examples:
        >>> row = RunResult("ring_allreduce", processes=2, devices=2)
        >>> row.status, row.step_ms, row.loss_curve
        ('ok', None, [])
    """

    strategy: str
    processes: int
    devices: int
    status: str = "ok"
    error: str | None = None
    wall_seconds: float = 0.0
    step_ms: float | None = None
    samples_per_second: float | None = None
    comm_mb_per_step: float | None = None
    pipeline_mb_per_step: float | None = None
    exposed_comm_ms: float | None = None
    pipeline_bubble: float | None = None
    final_loss: float | None = None
    accuracy: float | None = None
    max_param_diff: float | None = None
    peak_mb_per_rank: float | None = None
    peak_mb_by_rank: list[float] = field(default_factory=list)
    loss_curve: list[float] = field(default_factory=list)
    step_times_ms: list[float] = field(default_factory=list)


def _steady(values: list[float]) -> list[float]:
    return values[WARMUP_STEPS:] if len(values) > WARMUP_STEPS else values


def evaluate(config: DemoConfig, checkpoint: Path) -> tuple[dict[str, torch.Tensor], float, float]:
    """Load a checkpoint into a fresh demo model: its parameters, training-set loss and held-out accuracy."""
    model = DemoClassifier(config)
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        x, y = make_dataset(config, train=True).tensors
        loss = float(model.loss_fn(model(x), y))
        vx, vy = make_dataset(config, train=False).tensors
        accuracy = float(MulticlassAccuracy(num_classes=config.classes)(model(vx), vy))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, loss, accuracy


def _one_line(text: str, limit: int = 240) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _failure(name: str, work: Path, log: Path, code: int | None, timeout: float) -> tuple[str, str]:
    """The row's status and one-line reason: ``n/a`` for a configuration the strategy refuses before training."""
    # the first rank to fail says why: the others' errors are mostly about losing it
    reports = [(report, p) for p in work.glob(f"{name}.rank*.error.json") if (report := _read_report(p)) is not None]
    if code is None:
        return "timeout", f"no result within {timeout:.0f} s (see {log.parent.name}/{log.name})"
    if reports:
        # the time each rank took when it failed: a file's modification time is the kernel's coarse clock, which
        # may give a rank and the one that failed on losing it the same instant
        report = min(reports, key=lambda r: (r[0].get("failed_at", r[1].stat().st_mtime), _rank_of(r[1])))[0]
        refused = report["steps_done"] == 0 and report["type"] in _REFUSALS
        return ("n/a" if refused else "failed"), _one_line(f"{report['type']}: {report['message']}")
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
    return "failed", f"exit {code}" + (f": {_one_line(tail[0], 200)}" if tail else "")


def _read_report(path: Path) -> dict[str, Any] | None:
    """A rank's error report; ``None`` where the rank was killed while writing it."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


_REFUSALS = {"ValueError", "TypeError", "NotImplementedError", "MisconfigurationException", "PicklingError"}
"""Exceptions raised before the first step that mean "this strategy cannot run this model or configuration"."""


def run_one(name: str, session: Session) -> RunResult:
    """Run one strategy in its own processes (crashes and hangs become this row's status) and summarise it."""
    devices, work, timeout = session.devices, session.work, session.timeout
    result = RunResult(name, processes_for(name, devices), 1 if name == BASELINE else devices)
    log = session.logs / f"{name}.log"
    start = time.perf_counter()

    def report(seconds: float) -> None:
        done = _progress_line(work / f"{name}.progress", session.task.steps)
        session.progress(f"        ... {done} after {seconds:.0f} s")

    code = launch(name, session, log, report)
    result.wall_seconds = time.perf_counter() - start
    ranks = sorted(work.glob(f"{name}.rank*.json"))
    ranks = [p for p in ranks if not p.name.endswith(".error.json")]
    summary = work / f"{name}.rank0.json"
    if code != 0 or not summary.exists():
        result.status, result.error = _failure(name, work, log, code, timeout)
        return result
    if len(ranks) != result.processes:  # each process that trains writes one report: none may be left out
        result.status = "failed"
        result.error = f"{len(ranks)} of {result.processes} processes reported (see {log.parent.name}/{log.name})"
        return result
    data = json.loads(summary.read_text())
    every_rank = [json.loads(p.read_text()) for p in sorted(ranks, key=_rank_of)]
    result.peak_mb_by_rank = [rank["peak_mb"] for rank in every_rank]
    result.peak_mb_per_rank = max(result.peak_mb_by_rank)
    steady = _steady(data["step_ms"])
    result.step_times_ms = data["step_ms"]
    # each rank's loss is its replica's slice (every stage of a pipeline replica reports the replica's loss): the
    # mean over ranks is the global batch's loss, comparable with one device's
    curves = [rank["losses"] for rank in every_rank]
    result.loss_curve = [statistics.fmean(step) for step in zip(*curves, strict=False)]  # the shortest, if unequal
    if steady:
        result.step_ms = statistics.median(steady)
    if data["comm_bytes"]:
        # means: bytes and waits add up over the steps, and a periodic strategy (local_sgd) sends on few of them
        result.comm_mb_per_step = statistics.fmean(_steady(data["comm_bytes"])) / 1e6
        result.exposed_comm_ms = statistics.fmean(_steady(data["exposed_ms"]))
    if any(data.get("pipeline_bytes", [])):
        result.pipeline_mb_per_step = statistics.median(_steady(data["pipeline_bytes"])) / 1e6
    if data["bubbles"]:
        result.pipeline_bubble = statistics.median(_steady(data["bubbles"]))
    return result


def _progress_line(path: Path, steps: int) -> str:
    try:
        step, loss = path.read_text().split()
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return "starting"
    return f"step {step}/{steps}, loss {float(loss):.4f}"


def _rank_of(path: Path) -> int:
    return int(path.name.split(".rank")[1].split(".")[0])


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _resolve_accelerator(accelerator: str, devices: int) -> str:
    if accelerator not in ("auto", "cpu", "gpu", "cuda"):
        raise ValueError(f"accelerator {accelerator!r} is not one of auto, cpu, gpu, cuda")
    gpus = _cuda_devices()
    if accelerator == "cpu" or (accelerator == "auto" and gpus < devices):  # auto: CPU processes, said in the headline
        return "cpu"
    if not gpus:
        raise ValueError(f"accelerator={accelerator!r} but this machine has no CUDA device: use accelerator='cpu'")
    if devices > gpus:
        raise ValueError(
            f"devices={devices} but this machine has {gpus} CUDA device{'s' if gpus > 1 else ''}: use devices={gpus},"
            f" or accelerator='cpu' for {devices} CPU processes"
        )
    return "cuda"


def _batch_size(batch: Any) -> int | None:
    """The first dim of the first tensor with one in a nested batch."""
    return next((int(t.shape[0]) for _, t in _tensors(batch, "") if t.dim()), None)


def compare(
    strategies: Sequence[str] | None = None,
    config: DemoConfig | None = None,
    devices: int = 2,
    out: Path | str = Path("comparison"),
    timeout: float = 300.0,
    extra_imports: Sequence[str] | None = None,
    progress: Callable[[str], None] = print,
    *,
    model: Any = None,
    datamodule: Any = None,
    train_dataloaders: Any = None,
    steps: int | None = None,
    seed: int = 0,
    precision: str = "32-true",
    accelerator: str = "auto",
    keep_checkpoints: bool = False,
    progress_every: float = 10.0,
) -> list[RunResult]:
    """Train the demo (``config``) or your model with every strategy, each in its own processes, and compare them.

    ``model`` is a LightningModule class, a function returning one, or ``"package.module:factory"``; the data is
    ``datamodule=`` (a factory of a LightningDataModule) or ``train_dataloaders=`` (a factory of a DataLoader of global
    batches), or the model's own ``train_dataloader``. Every value is checked before any process starts (a
    ``ValueError`` naming the fix). Each row then gets its timings, communication, peak memory, the final loss, and
    the largest parameter difference from the single-device baseline; a strategy that cannot run the model gets
    status ``"n/a"`` and a one-line reason. ``out`` receives one log per strategy (``logs/``) and, with
    ``keep_checkpoints``, the final checkpoints (``checkpoints/``).

    Examples:
        >>> names = ["single", "ring_allreduce"]  # each trains in its own subprocess: seconds to minutes
        >>> results = compare(names, model="my_models:make_net", train_dataloaders="my_models:loader")  # doctest: +SKIP
        >>> [(r.strategy, r.status) for r in results]  # doctest: +SKIP
        [('single', 'ok'), ('ring_allreduce', 'ok')]
    """
    device_kind = _check_arguments(devices, timeout, datamodule, train_dataloaders, accelerator, precision)
    names = check_strategies(default_strategies() if strategies is None else list(strategies), device_kind)
    data = datamodule if datamodule is not None else train_dataloaders
    task = make_task(model, data, demo=config, steps=steps, seed=seed, precision=precision, accelerator=device_kind)
    global_batch, first = _global_batch(task, devices)
    progress(_headline(len(names), task, devices, device_kind, global_batch, accelerator == "auto"))
    out = Path(out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="compare-"))
    try:
        task_path = work / "task.pkl"
        dump_task(task, task_path)
        extra = list(extra_imports or [])
        session = Session(task, task_path, devices, work, logs, timeout, extra, progress, progress_every)
        results = _run_rows(names, session)
        _evaluate_all(results, task, work, first)
        _add_throughput(results, global_batch)
        if keep_checkpoints:
            _keep_checkpoints(work, out / "checkpoints")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def _check_arguments(
    devices: int, timeout: float, datamodule: Any, train_dataloaders: Any, accelerator: str, precision: str
) -> str:
    """The device kind to run on (``"cpu"`` or ``"cuda"``); ``ValueError`` naming the fix for a value that cannot
    work."""
    if devices < 1:
        raise ValueError(f"devices must be at least 1 (got {devices})")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds (got {timeout})")
    if datamodule is not None and train_dataloaders is not None:
        raise ValueError("pass datamodule= or train_dataloaders=, not both")
    device_kind = _resolve_accelerator(accelerator, devices)
    if precision == "16-mixed" and device_kind == "cpu":  # Lightning would switch to bf16-mixed with a warning
        raise ValueError("precision 16-mixed (fp16 autocast) needs a GPU; on CPU use bf16-mixed")
    return device_kind


def _global_batch(task: Task, devices: int) -> tuple[int | None, Any]:
    """The samples in one global batch (``None`` where unknown) and the user's first batch (``None`` for the demo);
    ``ValueError`` unless the batch splits evenly over ``devices``."""
    if task.demo is not None:
        if task.demo.global_batch % devices:
            raise ValueError(
                f"the global batch ({task.demo.global_batch}) must be a multiple of devices ({devices}): every"
                " data-parallel replica gets an equal slice"
            )
        return task.demo.global_batch, None
    try:
        first = first_global_batch(task, task.build_model())
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"building the model or data failed before any strategy ran: {err!r}") from err
    global_batch = _batch_size(first) if first is not None else None
    if global_batch is not None and global_batch % devices:
        raise ValueError(
            f"the data's batches hold {global_batch} samples, which does not split evenly over {devices} devices:"
            f" use a batch size that is a multiple of {devices} (each data-parallel replica trains on a slice)"
        )
    return global_batch, first


def _headline(count: int, task: Task, devices: int, device_kind: str, global_batch: int | None, auto: bool) -> str:
    """The progress line that opens a comparison: how many strategies, on what, with how many devices and steps;
    where ``auto`` chose CPU processes on a machine with too few GPUs, how to use the GPUs it has."""
    line = (
        f"Comparing {count} strategies on {task.label}, {devices} {'CUDA' if device_kind == 'cuda' else 'CPU'}"
        f" device{'s' if devices > 1 else ''} each, {task.steps} steps"
        + (f" of {global_batch} samples" if global_batch else "")
    )
    gpus = _cuda_devices()
    if auto and device_kind == "cpu" and 0 < gpus < devices:
        line += f" (this machine has {gpus} CUDA device{'s' if gpus > 1 else ''}: --accelerator gpu --devices {gpus})"
    return line


def _add_throughput(results: list[RunResult], global_batch: int | None) -> None:
    """Fill in each timed row's samples per second, where the global batch's size is known."""
    for result in results:
        if result.step_ms and global_batch:
            result.samples_per_second = global_batch / (result.step_ms / 1e3)


def _keep_checkpoints(work: Path, kept: Path) -> None:
    """Move the runs' final checkpoints out of the work folder (deleted afterwards) into ``kept``."""
    kept.mkdir(exist_ok=True)
    for ckpt in work.glob("*.ckpt"):
        shutil.move(str(ckpt), kept / ckpt.name)


def _run_rows(names: list[str], session: Session) -> list[RunResult]:
    """Every strategy's row in turn, their processes forked from the process's fork server where that is safe
    (Linux, CPU)."""
    session.forks = shared_fork_server() if fork_server_available(session.task.accelerator) else None
    return [_announced(name, i, len(names), session) for i, name in enumerate(names, 1)]


def _announced(name: str, i: int, count: int, session: Session) -> RunResult:
    """:func:`run_one`, with a progress line before and after."""
    procs = processes_for(name, session.devices)
    steps = session.task.steps
    session.progress(f"[{i}/{count}] {name}: {procs} process{'es' if procs > 1 else ''}, {steps} steps ...")
    result = run_one(name, session)
    after = f"        {result.status} in {result.wall_seconds:.1f} s" + (f": {result.error}" if result.error else "")
    session.progress(after)
    return result


def _evaluate_all(results: list[RunResult], task: Task, work: Path, first: Any) -> None:
    """Load every finished run's checkpoint here: its final loss (and the demo's accuracy) and its parameters, compared
    with the baseline's."""
    params: dict[str, dict[str, torch.Tensor]] = {}
    for result in results:
        if result.status != "ok":
            continue
        checkpoint = work / f"{result.strategy}.ckpt"
        try:
            if task.demo is not None:
                params[result.strategy], result.final_loss, result.accuracy = evaluate(task.demo, checkpoint)
                continue
            model = task.build_model()
            state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
            model.load_state_dict(state)
            params[result.strategy] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            result.final_loss = training_loss(model, first) if first is not None else None
        except Exception as err:  # a checkpoint that does not load is this row's failure, not the command's
            result.status, result.error = "failed", _one_line(f"checkpoint did not load: {err}")
    if BASELINE in params:
        base = params[BASELINE]
        for result in results:
            if result.strategy in params:
                mine = params[result.strategy]
                diffs = [float((mine[k].float() - base[k].float()).abs().max()) for k in base if base[k].numel()]
                result.max_param_diff = max(diffs, default=0.0)
