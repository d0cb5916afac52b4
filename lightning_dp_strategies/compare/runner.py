"""Run each strategy on the demo in its own subprocess, then evaluate every result the same way in this process."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torchmetrics.classification import MulticlassAccuracy

from lightning_dp_strategies.compare.demo import DemoClassifier, DemoConfig, make_dataset

BASELINE = "single"
"""The single-device baseline every other row is compared with."""
PREFERRED_ORDER = ("single", "dp", "ring_allreduce", "ddp", "hybrid_pipeline")
WARMUP_STEPS = 3


def available_strategies() -> list[str]:
    """The names ``compare`` accepts: the baseline, then every registered strategy (ours and Lightning's).

    Examples:
        >>> names = available_strategies()
        >>> names[0], "ring_allreduce" in names, "ddp" in names
        ('single', True, True)
    """
    return [BASELINE, *sorted(StrategyRegistry)]


def default_strategies() -> list[str]:
    """The baseline, ``dp``, ``ring_allreduce``, Lightning's ``ddp`` and ``hybrid_pipeline``, where registered.

    Examples:
        >>> default_strategies()[:4]
        ['single', 'dp', 'ring_allreduce', 'ddp']
    """
    names = set(available_strategies())
    return [n for n in PREFERRED_ORDER if n in names]


def processes_for(name: str, devices: int) -> int:
    """Processes a strategy starts: one for the baseline; what the registered class says (``launched_processes``,
    which this package's strategies and their subclasses have); else one per device, as Lightning's own launch.

    Examples:
        >>> [processes_for(name, 2) for name in ("single", "dp", "ring_allreduce", "ddp")]
        [1, 1, 2, 2]
    """
    if name == BASELINE:
        return 1
    strategy = StrategyRegistry[name]["strategy"] if name in StrategyRegistry else None
    count = getattr(strategy, "launched_processes", None)
    return int(count(devices)) if callable(count) else devices


@dataclass
class RunResult:
    """One row of the comparison (and its curves).

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
    loss_curve: list[float] = field(default_factory=list)
    step_times_ms: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- worker (subprocess)


class _Recorder(L.Callback):
    def __init__(self) -> None:
        self.start = 0.0
        self.step_ms: list[float] = []
        self.losses: list[float] = []
        self.comm_bytes: list[float] = []
        self.pipeline_bytes: list[float] = []
        self.exposed_ms: list[float] = []
        self.bubbles: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.step_ms.append((time.perf_counter() - self.start) * 1e3)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:
            loss = trainer.callback_metrics.get("train_loss")
        self.losses.append(float(loss) if loss is not None else float("nan"))
        stats = getattr(trainer.strategy, "step_stats", None)
        if stats is not None:
            self.comm_bytes.append(float(getattr(stats, "bytes_sent", 0)))
            self.exposed_ms.append(float(getattr(stats, "exposed_seconds", 0.0)) * 1e3)
            # hybrid_pipeline: activations and their gradients between stages, both directions, on this rank
            exchanged = getattr(stats, "pipeline_bytes_sent", 0) + getattr(stats, "pipeline_bytes_received", 0)
            self.pipeline_bytes.append(float(exchanged))
        pipeline = getattr(trainer.strategy, "pipeline_stats", None)  # hybrid_pipeline: idle over total, this rank
        if pipeline is not None and not pipeline.last.warmup:
            self.bubbles.append(float(pipeline.last.bubble))


def run_worker(name: str, config: DemoConfig, devices: int, out: Path) -> None:
    """Train the demo with one strategy (inside the launched processes) and write ``{name}.json`` and a checkpoint."""
    # one CPU core stands for one device: one intra-op thread per process (scatter/gather's replicas are threads)
    torch.set_num_threads(1)
    recorder = _Recorder()
    trainer = L.Trainer(
        strategy="auto" if name == BASELINE else name,
        accelerator="cpu",
        devices=1 if name == BASELINE else devices,
        max_steps=config.steps,
        use_distributed_sampler=False,  # the demo slices each global batch itself, identically for every strategy
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(DemoClassifier(config))
    trainer.save_checkpoint(out / f"{name}.ckpt")
    if trainer.is_global_zero:
        payload = {
            "step_ms": recorder.step_ms,
            "losses": recorder.losses,
            "comm_bytes": recorder.comm_bytes,
            "pipeline_bytes": recorder.pipeline_bytes,
            "exposed_ms": recorder.exposed_ms,
            "bubbles": recorder.bubbles,
        }
        (out / f"{name}.json").write_text(json.dumps(payload))


# ---------------------------------------------------------------------------------------------- parent


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


def run_one(
    name: str, config: DemoConfig, devices: int, out: Path, timeout: float, extra_imports: list[str]
) -> RunResult:
    """Run one strategy in a subprocess (crashes and hangs become this row's error) and summarise it."""
    result = RunResult(name, processes_for(name, devices), 1 if name == BASELINE else devices)
    cmd = [sys.executable, "-m", "lightning_dp_strategies", "compare", "--worker", name, "--output", str(out)]
    cmd += ["--devices", str(devices), "--config-json", json.dumps(asdict(config))]
    for module in extra_imports:
        cmd += ["--import", module]
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, 9)  # no rank outlives its row
            except ProcessLookupError:
                pass
    result.wall_seconds = time.perf_counter() - start
    summary = out / f"{name}.json"
    if code != 0 or not summary.exists():
        result.status = "timeout" if code is None else "failed"
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        result.error = (f"no result within {timeout:.0f} s" if code is None else f"exit {code}") + (
            f": {tail[0][:200]}" if tail else ""
        )
        return result
    data = json.loads(summary.read_text())
    steady = _steady(data["step_ms"])
    result.step_times_ms = data["step_ms"]
    result.loss_curve = data["losses"]
    if steady:
        result.step_ms = statistics.median(steady)
        result.samples_per_second = config.global_batch / (result.step_ms / 1e3)
    if data["comm_bytes"]:
        result.comm_mb_per_step = statistics.median(_steady(data["comm_bytes"])) / 1e6
        result.exposed_comm_ms = statistics.median(_steady(data["exposed_ms"]))
    if any(data.get("pipeline_bytes", [])):
        result.pipeline_mb_per_step = statistics.median(_steady(data["pipeline_bytes"])) / 1e6
    if data["bubbles"]:
        result.pipeline_bubble = statistics.median(_steady(data["bubbles"]))
    return result


def compare(
    strategies: list[str],
    config: DemoConfig,
    devices: int,
    out: Path,
    timeout: float = 300.0,
    extra_imports: list[str] | None = None,
    progress: Callable[[str], None] = print,
) -> list[RunResult]:
    """Run every strategy in turn and fill in loss, accuracy and the parameter difference from the baseline.

    Examples:
        >>> names = ["single", "ring_allreduce"]  # each trains in its own subprocess: seconds to minutes
        >>> results = compare(names, DemoConfig(steps=10), 2, Path("runs"), progress=lambda _: None)  # doctest: +SKIP
        >>> [(r.strategy, r.status) for r in results]  # doctest: +SKIP
        [('single', 'ok'), ('ring_allreduce', 'ok')]
    """
    out.mkdir(parents=True, exist_ok=True)
    results: list[RunResult] = []
    for i, name in enumerate(strategies, 1):
        procs = processes_for(name, devices)
        progress(f"[{i}/{len(strategies)}] {name}: {procs} process{'es' if procs > 1 else ''} ...")
        result = run_one(name, config, devices, out, timeout, extra_imports or [])
        progress(
            f"        {result.status} in {result.wall_seconds:.1f} s" + (f" ({result.error})" if result.error else "")
        )
        results.append(result)
    params: dict[str, dict[str, torch.Tensor]] = {}
    for result in results:
        if result.status != "ok":
            continue
        try:
            params[result.strategy], result.final_loss, result.accuracy = evaluate(
                config, out / f"{result.strategy}.ckpt"
            )
        except Exception as err:  # a checkpoint that does not load is this row's failure, not the command's
            result.status, result.error = "failed", f"checkpoint did not load: {err}"
    if BASELINE in params:
        base = params[BASELINE]
        for result in results:
            if result.strategy in params:
                mine = params[result.strategy]
                result.max_param_diff = max(float((mine[k] - base[k]).abs().max()) for k in base)
    return results
