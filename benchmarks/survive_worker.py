"""One rank of ``bench_survive.py``: the cluster benchmarks' MLP under ``RingAllReduceStrategy(fault_tolerant=True)``.

Started by ``torchrun`` on every simulated node (one process a node). Into ``--out`` each rank writes, as it goes:

- ``rank{R}.steps``: a line ``start STEP TIME`` when optimizer step ``STEP`` begins and ``end STEP TIME`` when it is
  done (``time.time()``, flushed at once, so a rank that dies leaves its steps so far);
- ``reached`` (rank 0 only): an empty file touched when step ``--mark-at`` begins, for the benchmark to cut a link;

and when training ends, ``rank{R}.pt`` (the final parameters) and ``rank{R}.json`` (steps done, the strategy's
``recoveries``); or ``rank{R}.error`` (the exception's last line) when ``fit`` raised, which it then raises again.
``--kill-rank R --kill-at STEP`` SIGKILLs rank ``R`` at the start of step ``STEP``
(:class:`~lightning_dp_strategies.core.failures.FailureInjector`).
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


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The rank's settings (the MLP's of :func:`_launch.add_mlp_arguments`, ``--steps``, where to write, what fails)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--mark-at", type=int, default=20, help="rank 0 touches OUT/reached when this step begins")
    add_mlp_arguments(parser)
    return parser.parse_args(argv)


def main() -> None:
    import lightning as L
    import torch

    from lightning_dp_strategies import RingAllReduceStrategy
    from lightning_dp_strategies.core.failures import FailureInjector

    torch.set_num_threads(1)  # the simulated nodes share the machine's cores
    args = parse()
    rank = int(os.environ["RANK"])
    out: Path = args.out
    injector = FailureInjector()
    if args.kill_rank is not None:
        injector.fail(rank=args.kill_rank, step=args.kill_at, kind="kill")

    class Clock(L.Callback):
        """Each step's start and end on this rank, written as they happen; the failure injected at a step's start."""

        def __init__(self) -> None:
            self.file = open(out / f"rank{rank}.steps", "a", buffering=1)

        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            step = trainer.global_step
            self.file.write(f"start {step} {time.time():.6f}\n")
            if rank == 0 and step == args.mark_at:
                (out / "reached").touch()
            injector.step(rank, step)

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            self.file.write(f"end {trainer.global_step - 1} {time.time():.6f}\n")

    try:
        trainer, model = fit_rank(lambda: mlp(args), lambda: RingAllReduceStrategy(fault_tolerant=True), Clock(), args)
    except BaseException as error:
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        (out / f"rank{rank}.error").write_text(f"{type(error).__name__}: {lines[0] if lines else ''}\n")
        traceback.print_exc()
        raise
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"rank{rank}.pt")
    survivors = trainer.strategy.survivors
    recoveries = [dataclasses.asdict(r) for r in survivors.recoveries] if survivors is not None else []
    result = {"rank": rank, "global_step": trainer.global_step, "recoveries": recoveries, "done_at": time.time()}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    print(f"rank {rank} finished {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
