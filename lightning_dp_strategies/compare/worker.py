"""The worker side of a comparison: one strategy's training, inside the processes launched for it."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.multiprocessing import ProcessRaisedException

from lightning_dp_strategies.compare.catalogue import BASELINE
from lightning_dp_strategies.compare.task import GlobalBatches, load_task

__all__ = ["run_worker"]


class _Recorder(L.Callback):
    """Records each training step: its time, loss, the strategy's communication and bubble, and (on global rank 0)
    a progress file the parent reads for its live line; at the end of the fit, writes ``{name}.rank{r}.json`` in
    ``work``. Every process that trains does so, also where a ``spawn`` or ``fork`` launcher started it from the
    process that called ``fit``."""

    def __init__(self, work: Path, name: str) -> None:
        self.work, self.name = work, name
        self.progress = work / f"{name}.progress"
        self.start = 0.0
        self.step_ms: list[float] = []
        self.losses: list[float] = []
        self.comm_bytes: list[float] = []
        self.pipeline_bytes: list[float] = []
        self.exposed_ms: list[float] = []
        self.bubbles: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        """Start the step's clock."""
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        """Record the step's time, loss, communication and bubble; write the progress file on global rank 0."""
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
        if trainer.is_global_zero:  # read by the parent for its live progress line
            self.progress.write_text(f"{len(self.step_ms)} {self.losses[-1]}")

    def steps_done(self) -> int:
        """Steps this process trained; where a launcher's ranks trained instead, the steps rank 0 reported."""
        if self.step_ms:
            return len(self.step_ms)
        try:
            return int(self.progress.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Write this rank's steps, losses, communication, bubbles and peak memory."""
        payload = {
            "step_ms": self.step_ms,
            "losses": self.losses,
            "comm_bytes": self.comm_bytes,
            "pipeline_bytes": self.pipeline_bytes,
            "exposed_ms": self.exposed_ms,
            "bubbles": self.bubbles,
            "peak_mb": _peak_mb(trainer),
        }
        (self.work / f"{self.name}.rank{trainer.global_rank}.json").write_text(json.dumps(payload))


class _ReportingTrainer(L.Trainer):
    """A ``Trainer`` whose fit, in whichever process runs it, writes that process's failure report. A ``spawn`` or
    ``fork`` launcher runs ``_fit_impl`` in the ranks it starts, where Lightning calls no ``on_exception`` hook; the
    launching process learns of one failed rank only, and where it looks late, of the first in rank order rather
    than the first to fail."""

    failure_recorder: _Recorder | None = None

    def _fit_impl(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._fit_impl(*args, **kwargs)
        except Exception as err:
            if self.failure_recorder is not None:
                _write_failure(err, self, self.failure_recorder)
            raise


def _peak_mb(trainer: L.Trainer) -> float:
    """This process's peak memory: CUDA memory allocated on its devices, else the process's peak resident set."""
    if trainer.strategy.root_device.type == "cuda":
        return max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())) / 1e6
    try:  # Linux: this process image's peak (getrusage's maxrss would include the launching parent's, kept over exec)
        status = Path("/proc/self/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) * 1024 / 1e6
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


_CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


def _raised(traceback: str) -> tuple[str, str]:
    """The exception's type and message at the end of ``traceback``'s text: in the last exception of a chain, the
    first line after its frames (each indented) and the lines after it. A message that holds another traceback's
    text (a rank's error passed on) stays whole."""
    lines = traceback.rstrip().splitlines()
    lines = lines[max((i for i, line in enumerate(lines) if line in _CHAINED), default=-1) + 1 :]
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")), 0)
    while start < len(lines) and (lines[start].startswith("  ") or not lines[start].strip()):
        start += 1
    tail = lines[start:]
    if not tail:
        return "", traceback.strip()
    kind, _, first = tail[0].partition(": ")
    return kind.rsplit(".", 1)[-1], "\n".join([first, *tail[1:]])


def _write_failure(err: Exception, trainer: L.Trainer | None, recorder: _Recorder) -> None:
    """Write ``{name}.rank{r}.error.json`` beside the reports: the exception's type and message, the steps done and
    when it failed (the runner gives the first failure's reason). A rank that a spawn or fork launcher started fails
    the launching process with its traceback's text: the reason is the rank's own exception, which that rank has
    written itself unless it could not. A report already written is kept: it is the earlier one."""
    failed_at = time.time()
    rank = trainer.global_rank if trainer is not None else _rank()
    kind, message = type(err).__name__, str(err)
    if isinstance(err, ProcessRaisedException):
        rank, (kind, message) = err.error_index, _raised(message)
    if isinstance(err, pickle.PicklingError):  # a spawn launch pickles the module and its class by reference
        message += " (spawn sends the model by reference: define it in an importable module, or use the fork "
        message += "launch, the strategy's `_notebook` name)"
    reason = {"type": kind, "message": message, "steps_done": recorder.steps_done(), "failed_at": failed_at}
    path = recorder.work / f"{recorder.name}.rank{rank}.error.json"
    if not path.exists():
        path.write_text(json.dumps(reason))


def _rank() -> int:
    """This process's global rank from the launcher's environment (0 when not launched)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def run_worker(name: str, task_path: Path, devices: int, work: Path) -> None:
    """Train the task with one strategy (inside the launched processes): each rank writes ``{name}.rank{r}.json``
    (:class:`_Recorder`) and waits until every rank has, then rank 0 a checkpoint; a rank that fails writes
    ``{name}.rank{r}.error.json`` (its one-line reason) and raises."""
    task = load_task(task_path)
    if task.accelerator == "cpu":
        torch.set_num_threads(1)  # one CPU core stands for one device (scatter/gather's replicas are threads)
    recorder = _Recorder(work, name)
    trainer: L.Trainer | None = None
    try:
        model = task.build_model()
        data = None if task.demo is not None else GlobalBatches(task.build_data())
        trainer = _ReportingTrainer(
            strategy="auto" if name == BASELINE else name,
            accelerator=task.accelerator,
            devices=1 if name == BASELINE else devices,
            precision=task.precision,  # type: ignore[arg-type]
            max_steps=task.steps,
            use_distributed_sampler=False,  # the global batches are cut per replica, identically for every strategy
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            default_root_dir=work / name,  # what the model's own callbacks write goes to the temporary work folder
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[recorder],
        )
        trainer.failure_recorder = recorder
        trainer.fit(model, datamodule=data)
    except Exception as err:
        _write_failure(err, trainer, recorder)
        raise
    # every rank has written its report before rank 0 can end: a launcher's ranks run in rank 0's session, which the
    # row kills once rank 0 has ended
    trainer.strategy.barrier("compare.reported")
    trainer.save_checkpoint(work / f"{name}.ckpt")
