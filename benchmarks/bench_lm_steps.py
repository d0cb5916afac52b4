"""Quality per step on the language model over several seeds: the optimizer steps each variant needs to reach ddp's
held-out loss, on this machine's loopback (no simulated cluster, no root).

The task, the model and its settings are ``bench_lm.py``'s (``benchmarks/lm_task.py``: a 7.2 M-parameter byte-level
Transformer, AdamW with its learning rate warmed up, 8 windows a process and step, 2 processes of one thread). Time is
not measured here: on a link, a variant's time to a loss is its steps to that loss times its step time there, which
``bench_lm.py`` measures on the simulated cluster. What this adds is the spread between seeds, which one
``bench_lm.py`` run cannot show: each seed is a different model initialisation and global batch sequence.

For each seed every variant trains ``--steps`` optimizer steps. From step ``--eval-from`` on, the ranks' averaged
model (for local SGD mid-period: the mean of the ranks' parameters, in a copy) is scored after every step on
``bench_lm.py``'s 64 held-out windows; local SGD's trajectory does not depend on when it is scored. A seed's target
is ddp's loss after ``--target-step`` steps (39 by default: the steps ddp trains within ``bench_lm.py``'s 60 s budget
at 200 Mbit/s between 2 nodes). The table gives, per seed, the first step at which each variant's loss is at or
below the target, ddp's own included (a loss curve with bumps can cross before ``--target-step``).
Variants (one line each in :data:`VARIANTS`):

    ddp                    Lightning's own DDP
    streaming_diloco       the registered name (sync_every="auto": on loopback it chooses the period and delay it
                           chooses at 200 Mbit, which the JSON records)
    streaming_fp32         the same with the outer gradients sent in fp32
    streaming_mixing_half  the same with mixing=0.5 (the streaming DiLoCo paper's)
    local_sgd              LocalSGDStrategy(sync_every=8), as in bench_lm.py

and, named with ``--variants`` (:data:`DEFAULT_VARIANTS`), one knob of ``streaming_diloco`` turned:

    streaming_outer_lr_1.2  the averaged change applied with an outer learning rate of 1.2 (SGD, no momentum)
    streaming_every_2       two fragments, each synchronised every 2 steps (twice the bytes)
    streaming_delay_0       each fragment's average merged at once (delay=0: the synchronisation waits for it)

and local SGD's bound on them (``--variants ddp local_sgd_every_1``):

    local_sgd_every_1       LocalSGDStrategy(sync_every=1): the ranks' parameters averaged after every step, each
                            rank's own AdamW stepping on its own half of the global batch

Usage::

    python benchmarks/bench_lm_steps.py --seeds 0 1 2 3 --json benchmarks/results/lm_steps.json
    python benchmarks/bench_lm_steps.py --seeds 0 1 2 3 --variants ddp streaming_diloco streaming_outer_lr_1.2 \
        streaming_every_2 --json benchmarks/results/lm_steps_knobs.json
    python benchmarks/bench_lm_steps.py --seeds 0 1 2 3 --variants ddp local_sgd_every_1 \
        --json benchmarks/results/lm_steps_every_1.json
    python benchmarks/bench_lm_steps.py --seeds 0 1 2 3 --variants ddp streaming_delay_0 \
        --json benchmarks/results/lm_steps_delay_0.json
    python benchmarks/bench_lm_steps.py --seeds 0 1 2 3 --variants ddp streaming_diloco --steps 225 \
        --eval-from 185 --target-step 195 --json benchmarks/results/lm_steps_long.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STREAMING = 'sync_every="auto", fragments=4, delay=1, outer_precision='
OUTER_SGD = "lambda p: torch.optim.SGD(p, lr="

VARIANTS: dict[str, str] = {
    "ddp": '"ddp"',
    "streaming_diloco": '"streaming_diloco"',
    "streaming_fp32": f'LocalSGDStrategy({STREAMING}"fp32")',
    "streaming_mixing_half": f'LocalSGDStrategy({STREAMING}"int4", mixing=0.5)',
    "local_sgd": "LocalSGDStrategy(sync_every=8)",
    "streaming_outer_lr_1.2": f'LocalSGDStrategy({STREAMING}"int4", outer_optimizer={OUTER_SGD}1.2))',
    "streaming_every_2": 'LocalSGDStrategy(sync_every=2, fragments=2, delay=1, outer_precision="int4")',
    "local_sgd_every_1": "LocalSGDStrategy(sync_every=1)",
    "streaming_delay_0": 'LocalSGDStrategy(sync_every=4, fragments=4, delay=0, outer_precision="int4")',
}
"""Each variant's ``Trainer(strategy=...)``, as Python evaluated over the package's names and ``torch``."""

DEFAULT_VARIANTS = ["ddp", "streaming_diloco", "streaming_fp32", "streaming_mixing_half", "local_sgd"]
"""What runs without ``--variants``. The others turn one knob of ``streaming_diloco`` (``--variants ddp
streaming_diloco streaming_outer_lr_1.2 streaming_every_2``): its averaged change applied with an outer learning rate
of 1.2 instead of 1 (plain SGD, no momentum), and two fragments synchronised every 2 steps instead of four every 4
(the same delay of one step, twice the bytes)."""


def worker(args: argparse.Namespace) -> None:
    """One rank of one variant and seed (started by torchrun on loopback)."""
    import lightning as L
    import torch
    from _launch import QUIET_TRAINER
    from bench_lm import arguments, lm_config, strategy_from
    from lm_task import TrainWindows, averaged_state, corpus, held_out_loss, lightning_module, val_batches
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    config = lm_config(arguments().parse_args([]))  # bench_lm.py's model and training settings, as it runs them
    train, val = corpus()
    batches = val_batches(val, config.context, count=64)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    L.seed_everything(args.seed)

    class Score(L.Callback):
        def __init__(self) -> None:
            self.points: list[list[float]] = []

        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *_: Any) -> None:
            if trainer.global_step < args.eval_from:
                return
            state = averaged_state(trainer, module)
            if trainer.global_rank == 0:
                self.points.append([trainer.global_step, held_out_loss(module, state, batches)])

    score = Score()
    trainer = L.Trainer(
        strategy=strategy_from(VARIANTS[args.worker]),
        accelerator="cpu",
        devices=world,
        max_steps=args.steps,
        callbacks=[score],
        **QUIET_TRAINER,
    )
    data = DataLoader(TrainWindows(train, config, rank, world, seed=args.seed + 1), batch_size=None)
    trainer.fit(lightning_module(config), data)
    if trainer.global_rank == 0:
        local = getattr(trainer.strategy, "local_sgd", None)
        chosen = None if local is None else {"sync_every": local.sync_every, "delay": local.delay}
        Path(args.out).write_text(json.dumps({"points": score.points, "local_sgd": chosen}))


def first_at_or_below(points: list[list[float]], target: float) -> int | None:
    """The first step whose loss is at or below ``target``; ``None`` if none is.

    Examples:
        >>> first_at_or_below([[30, 2.7], [31, 2.6], [32, 2.65], [33, 2.5]], 2.6)
        31
        >>> first_at_or_below([[30, 2.7]], 2.6) is None
        True
    """
    return next((int(step) for step, loss in points if loss <= target), None)


def summarize(runs: dict[int, dict[str, dict[str, Any]]], target_step: int) -> dict[int, dict[str, Any]]:
    """Per seed: ddp's loss at ``target_step`` as the target, and each variant's first step at or below it."""
    seeds = {}
    for seed, variants in runs.items():
        target = dict((int(s), loss) for s, loss in variants["ddp"]["points"])[target_step]
        steps = {name: first_at_or_below(run["points"], target) for name, run in variants.items()}
        seeds[seed] = {"target_loss": target, "steps_to_target": steps}
    return seeds


def table(seeds: dict[int, dict[str, Any]], variants: list[str], limit: int) -> list[list[Any]]:
    """One row per variant: its steps to each seed's target, and their mean over the seeds (where every seed got
    there within ``limit`` steps)."""
    rows = []
    for name in variants:
        steps = [seeds[seed]["steps_to_target"][name] for seed in sorted(seeds)]
        mean = f"{statistics.mean(steps):.1f}" if None not in steps else f"> {limit} in some seed"
        rows.append([name, *[str(s) if s is not None else f"> {limit}" for s in steps], mean])
    return rows


def quote(seeds: dict[int, dict[str, Any]], target_step: int) -> str:
    """The sentence the docs quote: each variant's mean steps to the targets against ddp's, and the seeds' spread."""
    order = sorted(seeds)

    def said(name: str) -> str:
        steps = [seeds[s]["steps_to_target"][name] for s in order]
        each = ", ".join(str(s) if s is not None else "not within the run" for s in steps)
        mean = f"a mean of {statistics.mean(steps):.1f}" if None not in steps else "no mean (a seed fell short)"
        return f"`{name}` {mean} ({each})"

    others = [name for name in seeds[order[0]]["steps_to_target"] if name != "ddp"]
    return (
        f"Over seeds {', '.join(map(str, order))}, the steps to ddp's loss after {target_step} steps were: ddp itself "
        f"{said('ddp').removeprefix('`ddp` ')}; " + "; ".join(said(name) for name in others) + "."
    )


def measure(args: argparse.Namespace) -> dict[int, dict[str, dict[str, Any]]]:
    """Every variant for every seed, one after another."""
    from _launch import torchrun_local

    runs: dict[int, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="lm-steps-") as tmp:
        for seed in args.seeds:
            for variant in args.variants:
                out = Path(tmp) / f"{variant}-{seed}.json"
                script = [str(Path(__file__).resolve()), "--worker", variant, "--out", str(out)]
                script += ["--seed", str(seed), "--steps", str(args.steps), "--eval-from", str(args.eval_from)]
                torchrun_local(2, script, f"{variant} seed {seed}", timeout=1800)
                runs.setdefault(seed, {})[variant] = json.loads(out.read_text())
                found = runs[seed][variant]["points"]
                print(f"  seed {seed} {variant:22s} loss {found[-1][1]:.4f} after {found[-1][0]} steps", flush=True)
    return runs


def main() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _launch import parse_or_work
    from _results import Report, machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps each variant trains")
    parser.add_argument("--eval-from", type=int, default=28, help="the first step after which the model is scored")
    parser.add_argument("--target-step", type=int, default=39, help="ddp's step whose loss is a seed's target")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # a worker's
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--json", help="write the results here")
    args = parse_or_work(parser, worker)
    if args is None:
        return
    if "ddp" not in args.variants or not args.eval_from <= args.target_step <= args.steps:
        parser.error("the targets need ddp, and --eval-from <= --target-step <= --steps")
    if args.dry_run:
        for seed in args.seeds:
            for variant in args.variants:
                print(f"seed {seed}: {variant:22s} {VARIANTS[variant]}")
        return
    started = machine()
    runs = measure(args)
    seeds = summarize(runs, args.target_step)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "out", "seed", "dry_run")}
    report = Report("lm_steps", settings, started)
    chosen = {v: r["local_sgd"] for v, r in runs[args.seeds[0]].items() if r["local_sgd"] is not None}
    report.table(
        f"Optimizer steps to ddp's held-out loss after {args.target_step} steps (2 processes, loopback)",
        ["variant", *[f"seed {s}" for s in sorted(seeds)], "mean"],
        table(seeds, args.variants, args.steps),
        [
            "Targets (ddp's loss after the target step): "
            + ", ".join(f"seed {s} {seeds[s]['target_loss']:.4f}" for s in sorted(seeds))
            + ".",
            "Periods in use (seed "
            + str(args.seeds[0])
            + "): "
            + ", ".join(f"{v} sync_every={c['sync_every']}, delay={c['delay']}" for v, c in chosen.items())
            + ".",
        ],
    )
    report.data["quotes"] = {"steps": quote(seeds, args.target_step)}
    report.data["seeds"] = {str(s): {**seeds[s], "runs": runs[s]} for s in sorted(seeds)}
    report.save(args.json)
    for row in report.data["tables"][0]["rows"]:
        print("  ".join(str(c) for c in row))


if __name__ == "__main__":
    main()
