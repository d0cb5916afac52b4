"""One rank of ``bench_survive.py``: the cluster benchmarks' MLP under a strategy with ``fault_tolerant=True``.

``--strategy ring_allreduce`` (the default) trains with ``RingAllReduceStrategy(fault_tolerant=True)``,
``--strategy local_sgd`` with ``LocalSGDStrategy(sync_every=N, fault_tolerant=True)`` (``--sync-every N``, 8 by
default).

Started by ``torchrun`` on every simulated node (one process a node). Into ``--out`` each rank writes, as it goes:

- ``rank{R}.steps``: a line ``start STEP TIME`` when optimizer step ``STEP`` begins and ``end STEP TIME`` when it is
  done (``time.time()``, flushed at once, so a rank that dies leaves its steps so far);
- ``reached`` (rank 0 only): an empty file touched when step ``--mark-at`` begins, for the benchmark to cut a link;

and when training ends, ``rank{R}.pt`` (the final parameters) and ``rank{R}.json`` (steps done, the strategy's
``recoveries`` and ``joins``); or ``rank{R}.error`` (the exception's last line) when ``fit`` raised, which it then
raises again. ``--kill-rank R --kill-at STEP`` SIGKILLs rank ``R`` at the start of step ``STEP``
(:class:`~lightning_dp_strategies.core.failures.FailureInjector`). ``--epoch-steps N`` makes the data one epoch of
``N`` steps (passed over again until ``--steps``); by default the run is one epoch.

A survivor writes ``joined STEP TIME`` into its steps file when it took replacements in (``strategy.survival.joins``
grew, at an epoch's start) and goes on with step ``STEP``. A replacement (``LDPS_JOIN=1`` in its environment, started
by its own torchrun agent) writes its files under the name ``rank{R}-join`` instead of ``rank{R}``, and
``rank{R}-join.admitted`` (JSON) as soon as its setup is over: ``admitted_at`` (when its setup hook ran, its join
already answered), the ``epoch``, ``leader`` and ``joining`` of ``strategy.survival.admission``, and at the start of
its training ``train_start_at`` and ``global_step`` (restored from the leader).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from _launch import add_mlp_arguments, fit_rank, mlp

STRATEGIES = ("ring_allreduce", "local_sgd")
"""What ``--strategy`` chooses: the strategy every rank trains with, ``fault_tolerant=True``."""


def add_strategy_arguments(parser: argparse.ArgumentParser) -> None:
    """``--strategy`` (:data:`STRATEGIES`) and ``--sync-every`` (local SGD's period), as :func:`strategy` reads
    them."""
    parser.add_argument("--strategy", default="ring_allreduce", choices=STRATEGIES)
    parser.add_argument("--sync-every", type=int, default=8, help="local_sgd: optimizer steps between averagings")


def strategy(args: argparse.Namespace) -> Any:
    """The fault-tolerant strategy ``args.strategy`` names."""
    from lightning_dp_strategies import LocalSGDStrategy, RingAllReduceStrategy

    if args.strategy == "local_sgd":
        return LocalSGDStrategy(sync_every=args.sync_every, fault_tolerant=True)
    return RingAllReduceStrategy(fault_tolerant=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The rank's settings (the MLP's of :func:`_launch.add_mlp_arguments`, ``--steps``, where to write, what fails)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--mark-at", type=int, default=20, help="rank 0 touches OUT/reached when this step begins")
    parser.add_argument("--epoch-steps", type=int, default=None, help="steps an epoch (default: --steps)")
    add_mlp_arguments(parser)
    add_strategy_arguments(parser)
    return parser.parse_args(argv)


def main() -> None:
    import lightning as L
    import torch

    from lightning_dp_strategies.core.failures import FailureInjector
    from lightning_dp_strategies.core.fault_tolerance import JOIN_ENV

    torch.set_num_threads(1)  # the simulated nodes share the machine's cores
    args = parse()
    rank = int(os.environ["RANK"])
    out: Path = args.out
    name = f"rank{rank}-join" if os.environ.get(JOIN_ENV) == "1" else f"rank{rank}"
    injector = FailureInjector()
    if args.kill_rank is not None:
        injector.fail(rank=args.kill_rank, step=args.kill_at, kind="kill")

    class Clock(L.Callback):
        """Each step's start and end on this rank, written as they happen; the failure injected at a step's start;
        the replacements taken in (a survivor) or the admission (a replacement)."""

        def __init__(self) -> None:
            self.file = open(out / f"{name}.steps", "a", buffering=1)
            self.joins = 0
            self.admitted: dict[str, Any] | None = None

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            admission = trainer.strategy.survival.admission
            if admission is not None:  # a replacement: its join answered while the strategy set up
                self.admitted = {"admitted_at": time.time(), **dataclasses.asdict(admission)}
                self._write_admitted()

        def on_train_start(self, trainer: L.Trainer, *_: Any) -> None:
            if self.admitted is not None:  # the leader's state restored: the step it goes on from
                self.admitted.update(train_start_at=time.time(), global_step=trainer.global_step)
                self._write_admitted()

        def _write_admitted(self) -> None:
            (out / f"{name}.admitted").write_text(json.dumps(self.admitted))

        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            step = trainer.global_step
            joins = trainer.strategy.survival.joins
            if len(joins) > self.joins:  # taken in just before this batch
                self.joins = len(joins)
                self.file.write(f"joined {step} {time.time():.6f}\n")
            self.file.write(f"start {step} {time.time():.6f}\n")
            if rank == 0 and step == args.mark_at:
                (out / "reached").touch()
            injector.step(rank, step)

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            self.file.write(f"end {trainer.global_step - 1} {time.time():.6f}\n")

    try:
        trainer, model = fit_rank(lambda: mlp(args), lambda: strategy(args), Clock(), args, args.epoch_steps)
    except BaseException as error:
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        (out / f"{name}.error").write_text(f"{type(error).__name__}: {lines[0] if lines else ''}\n")
        traceback.print_exc()
        raise
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{name}.pt")
    survivors = trainer.strategy.survivors
    recoveries = [dataclasses.asdict(r) for r in survivors.recoveries] if survivors is not None else []
    joins = trainer.strategy.survival.joins
    result = {"rank": rank, "global_step": trainer.global_step, "recoveries": recoveries, "joins": joins}
    result["done_at"] = time.time()
    (out / f"{name}.json").write_text(json.dumps(result))
    print(f"rank {rank} finished {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
