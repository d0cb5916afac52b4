"""Benchmark the per-rank peak memory of ``hybrid_pipeline`` at S = 1, 2 and 4 stages, as ratios to S = 1.

The model's body is ``--blocks`` equal blocks (each ``Linear(width, width)``, ``Tanh``, ``Linear(width, width)``),
built on the meta device in ``configure_model`` (deferred initialization: each stage materializes only its own
blocks). It trains for ``--steps`` steps with Adam (optimizer state twice the parameters) on a tiny batch, on the CPU
with ``devices=S`` and ``HybridPipelineStrategy(pipeline_stages=S, micro_batches=2)`` (S = 1 too), one thread per
rank; a ``ModelCheckpoint`` saves the whole model once during ``fit``, at the end of the epoch.

Each rank takes its resident memory (``VmRSS``) just before ``trainer.fit`` (after the imports and the module's
construction) as its baseline and resets the kernel's high-water mark there (``5`` into ``/proc/self/clear_refs``),
then reads ``VmHWM`` when ``fit`` has returned: peak - baseline is what training and checkpointing took on that rank.
For each S the table prints it per rank, the max over ranks, that max as a ratio to the S = 1 figure, and next to it
the target ``1/S + the largest block's share of the parameters + 0.10``. Nothing is asserted. ``--json`` also holds
each rank's figure just before the checkpoint's save, which separates training from saving. Linux only.

Each S runs in a worker process of its own (``--worker S OUTDIR``, every rank writes ``OUTDIR/rank{r}.json``), one S
after the other; Lightning's popen launcher starts the other ranks by running this script again with the same
arguments.

Usage::

    python benchmarks/bench_pipeline_memory.py [--stages 1 2 4] [--blocks 16] [--width 2048] [--steps 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _launch import child_env, free_port, run_together
from torch import Tensor, nn

BATCH = 4  # rows per step: two micro-batches of two, so activations are negligible next to the parameters
MICRO_BATCHES = 2
MB = 2**20


def build_body(blocks: int, width: int) -> nn.Sequential:
    """``blocks`` equal blocks of two ``width x width`` linear layers."""
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)) for _ in range(blocks)]
    )


def block_parameters(blocks: int, width: int) -> list[int]:
    """The number of parameters of each block (counted on the meta device: no memory)."""
    with torch.device("meta"):
        body = build_body(blocks, width)
    return [sum(p.numel() for p in block.parameters()) for block in body]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    """Set this process's ``VmHWM`` to its current ``VmRSS``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---------------------------------------------------------------------------------------------------- worker: one fit
def _worker(stages: int, out: Path, blocks: int, width: int, steps: int, timeout: float) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp_strategies import HybridPipelineStrategy

    class MemoryNet(L.LightningModule):
        pipeline_body = "body"

        def configure_model(self) -> None:
            if hasattr(self, "body"):
                return
            with torch.device("meta"):  # deferred: each stage materializes its own blocks at setup
                self.body = build_body(blocks, width)

        def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
            return F.mse_loss(output, target)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            return self.pipeline_loss(self.body(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Peak(L.Callback):
        """``VmHWM`` before the checkpoint's save (Lightning runs ``ModelCheckpoint``'s epoch-end hook after the other
        callbacks') and at the end of training, after it (before the strategy's teardown)."""

        def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            self.before_save_kb = _status_kb("VmHWM")

        def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            self.train_end_kb = _status_kb("VmHWM")

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(steps * BATCH, width, generator=generator), torch.randn(steps * BATCH, width, generator=generator)
    )
    peak, checkpoint = Peak(), ModelCheckpoint(dirpath=out / "ckpt", filename="last")
    trainer = L.Trainer(
        strategy=HybridPipelineStrategy(pipeline_stages=stages, micro_batches=MICRO_BATCHES, timeout=timeout),
        accelerator="cpu",
        devices=stages,
        max_epochs=1,
        max_steps=steps,
        use_distributed_sampler=False,  # one replica: every stage reads the same batches
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[peak, checkpoint],
    )
    model = MemoryNet()
    loader = DataLoader(data, batch_size=BATCH)
    baseline_kb = _status_kb("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    trainer.fit(model, loader)
    seconds = time.perf_counter() - start
    after_kb = _status_kb("VmHWM")
    saved = out / "ckpt" / "last.ckpt"
    result = {
        "rank": trainer.global_rank,
        "baseline_mb": baseline_kb / 1024,
        "peak_mb": after_kb / 1024,
        "delta_mb": (after_kb - baseline_kb) / 1024,
        "delta_before_save_mb": (getattr(peak, "before_save_kb", after_kb) - baseline_kb) / 1024,
        "delta_train_end_mb": (getattr(peak, "train_end_kb", after_kb) - baseline_kb) / 1024,
        "fit_seconds": seconds,
        "steps": trainer.global_step,
        "checkpoint_mb": saved.stat().st_size / MB if saved.exists() else None,
    }
    with open(out / f"rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)


# ------------------------------------------------------------------------------------------ parent: one S at a time
def _run_stages(stages: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run the worker for ``stages`` (it launches the other ranks) and read every rank's result."""
    with tempfile.TemporaryDirectory(prefix=f"pipeline-memory-s{stages}-") as tmp:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(stages), tmp]
        command += ["--blocks", str(args.blocks), "--width", str(args.width), "--steps", str(args.steps)]
        command += ["--timeout", str(args.timeout)]
        # the other ranks, which the launcher starts, are killed with it when it ends or runs out of time
        done = run_together([command], args.timeout, child_env(PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port())))
        output, seconds = done.outputs[0], done.seconds
        failure = f"exit status {done.codes[0]}" if done.codes[0] else None
        if done.timed_out:
            failure = f"did not finish within {args.timeout:.0f} s"
        ranks = [json.loads(p.read_text()) for r in range(stages) if (p := Path(tmp) / f"rank{r}.json").exists()]
    if failure is None and len(ranks) < stages:
        failure = f"only {len(ranks)} of {stages} ranks wrote a result"
    if failure is not None:
        print(f"S={stages}: {failure}; output (last 6000 characters):\n{output[-6000:]}", file=sys.stderr)
    return {"stages": stages, "seconds": seconds, "ranks": ranks, "failure": failure}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4], help="pipeline stages to measure")
    parser.add_argument("--blocks", type=int, default=16, help="blocks of the body")
    parser.add_argument("--width", type=int, default=2048, help="width of each block's two linear layers")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per S (and the collectives' timeout)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", nargs=2, metavar=("S", "OUTDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(int(args.worker[0]), Path(args.worker[1]), args.blocks, args.width, args.steps, args.timeout)
        return

    sizes = block_parameters(args.blocks, args.width)
    share = max(sizes) / sum(sizes)
    runs = [_run_stages(s, args) for s in args.stages]
    reference = next((run for run in runs if run["stages"] == 1 and not run["failure"]), None)
    base = max(r["delta_mb"] for r in reference["ranks"]) if reference else None

    print(
        f"hybrid_pipeline, peak memory per rank above its baseline (VmHWM after fit - VmRSS before fit), CPU/gloo\n"
        f"{args.blocks} blocks x {sizes[0] * 4 / MB:.1f} MB = {sum(sizes) * 4 / MB:.0f} MB of fp32 parameters "
        f"(largest block {share:.4f} of them)\n"
        f"Adam, batch {BATCH}, M={MICRO_BATCHES}, {args.steps} steps, one checkpoint saved during fit; "
        f"target = 1/S + {share:.4f} + 0.10"
    )
    print(f"{'S':>2} {'per rank MB (rank 0, 1, ...)':<36} {'max MB':>8} {'ratio':>7} {'target':>7} {'<= target':>9}")
    rows: list[list[str]] = []
    for run in runs:
        s = run["stages"]
        if run["failure"]:
            print(f"{s:>2} failed: {run['failure']}")
            rows.append([str(s), f"failed: {run['failure']}", "", "", "", ""])
            continue
        deltas = [r["delta_mb"] for r in sorted(run["ranks"], key=lambda r: r["rank"])]
        most = max(deltas)
        target = 1 / s + share + 0.10
        ratio = most / base if base else float("nan")
        run.update(max_mb=most, ratio=ratio, target=target)
        per_rank = ", ".join(f"{d:.0f}" for d in deltas)
        verdict = "yes" if ratio <= target else "no"
        print(f"{s:>2} {per_rank:<36} {most:>8.0f} {ratio:>7.3f} {target:>7.3f} {verdict:>9}")
        rows.append([str(s), per_rank, f"{most:.0f}", f"{ratio:.3f}", f"{target:.3f}", verdict])
    baselines = {run["stages"]: [round(r["baseline_mb"]) for r in run["ranks"]] for run in runs}
    print(f"baselines MB (per S, per rank): {baselines}; wall seconds per S: ", end="")
    print(", ".join(f"S={run['stages']} {run['seconds']:.0f}" for run in runs))

    if args.json:
        from _results import Report

        config = {"blocks": args.blocks, "width": args.width, "steps": args.steps, "batch": BATCH}
        report = Report("pipeline_memory", {k: v for k, v in vars(args).items() if k != "worker"})
        report.note(
            f"{args.blocks} blocks x {sizes[0] * 4 / MB:.1f} MB = {sum(sizes) * 4 / MB:.0f} MB of fp32 parameters "
            f"(largest block {share:.4f} of them); Adam, batch {BATCH}, M={MICRO_BATCHES}, {args.steps} steps, one "
            f"checkpoint saved during fit"
        )
        columns = ["S", "per rank MB (rank 0, 1, ...)", "max MB", "ratio to S=1", "target", "<= target"]
        report.table("Peak memory per rank above its baseline (VmHWM after fit - VmRSS before fit)", columns, rows)
        report.data.update(config=config, parameter_mb=sum(sizes) * 4 / MB, largest_block_share=share, runs=runs)
        report.save(args.json)


if __name__ == "__main__":
    main()
