"""The command's arguments, and the checks that need nothing installed: ``--help`` and wrong values are answered
here, before anything runs.

Only a valid command goes on to run (:mod:`lightning_dp_strategies.cli.run`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

from lightning_dp_strategies.compare.spec import DEMO_GLOBAL_BATCH, PRECISIONS

__all__ = ["check", "parser", "version"]


def version() -> str:
    """The installed package's version, read from its metadata (the parser sits below the package root and does not
    import it)."""
    try:
        return importlib.metadata.version("lightning-dp-strategies")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    """The command line: ``lightning-dp-strategies compare [options]``."""
    top = argparse.ArgumentParser(prog="lightning-dp-strategies", description="Data-parallel Lightning strategies.")
    top.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = top.add_subparsers(dest="command", required=True)
    cmp = commands.add_parser(
        "compare",
        help="train a model with each strategy and compare them side by side",
        description="Train the built-in demo (synthetic data, an MLP), or your own LightningModule and data, with"
        " each strategy on the same global batches, each in its own processes; print a table and write"
        " comparison.json, comparison.png and one log per strategy to the output folder.",
    )
    _what_to_train(cmp)
    _how_to_run(cmp)
    return top


def _what_to_train(cmp: argparse.ArgumentParser) -> None:
    """The model, the data, the strategies and the training run."""
    cmp.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="your model: an importable callable (a LightningModule class or a function) returning a LightningModule,"
        " e.g. my_models:make_net (modules in the current folder are importable); default: the built-in demo",
    )
    cmp.add_argument(
        "--data",
        metavar="MODULE:FACTORY",
        help="your data: a callable returning a LightningDataModule or a DataLoader of global batches (default: the"
        " model's own train_dataloader); needs --model",
    )
    cmp.add_argument(
        "--strategies", help="comma-separated names (default: single,dp,hybrid_pipeline,ring_allreduce,ddp)"
    )
    cmp.add_argument("--devices", type=int, default=2, help="devices or processes per strategy (default 2)")
    cmp.add_argument("--steps", type=int, default=30, help="optimizer steps per strategy (default 30)")
    cmp.add_argument(
        "--precision", choices=PRECISIONS, default="32-true", help="the Trainer's precision (default 32-true)"
    )
    cmp.add_argument(
        "--accelerator",
        choices=("auto", "cpu", "gpu", "cuda"),
        default="auto",
        help="auto (default): CUDA GPUs when there are --devices of them, else CPU processes (one core per device)",
    )
    cmp.add_argument(
        "--model-size",
        choices=["small", "medium", "large"],
        help="demo MLP: small ~0.04 M, medium ~1.1 M (default), large ~16.6 M parameters",
    )
    cmp.add_argument(
        "--global-batch",
        type=int,
        help=f"demo: samples per optimizer step, all ranks (default {DEMO_GLOBAL_BATCH}); your data sets its own",
    )


def _how_to_run(cmp: argparse.ArgumentParser) -> None:
    """Where the results go, the seed, the time limit, extra imports, and the worker's own arguments."""
    cmp.add_argument("--output", type=Path, default=Path("comparison"), help="output folder (default ./comparison)")
    cmp.add_argument("--keep-checkpoints", action="store_true", help="keep each strategy's final checkpoint")
    cmp.add_argument("--seed", type=int, default=0, help="seed for the model's initial weights and the demo data")
    cmp.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before one strategy's run is abandoned (default 300)"
    )
    cmp.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (it may register more strategy names); repeatable",
    )
    cmp.add_argument("--worker", help=argparse.SUPPRESS)
    cmp.add_argument("--task", type=Path, help=argparse.SUPPRESS)


def check(args: argparse.Namespace) -> str | None:
    """The first value that is wrong whatever is installed, as a message naming the fix (``None``: all fine).

    Examples:
        >>> check(parser().parse_args(["compare", "--global-batch", "0"]))
        '--global-batch 0: it must be at least 1'
        >>> check(parser().parse_args(["compare", "--strategies", ",,"]))
        '--strategies ",,": no strategy named; pass names separated by commas, for example single,ring_allreduce'
    """
    if args.worker:
        return None
    if args.steps < 1:
        return f"--steps {args.steps}: it must be at least 1"
    if args.devices < 1:
        return f"--devices {args.devices}: it must be at least 1"
    if not args.timeout > 0:
        return f"--timeout {args.timeout:g}: it must be a positive number of seconds"
    if args.strategies is not None and not [n for n in args.strategies.split(",") if n.strip()]:
        return (
            f'--strategies "{args.strategies}": no strategy named; pass names separated by commas, for example'
            " single,ring_allreduce"
        )
    if args.model is None:
        if args.data is not None:
            return "--data needs --model: the built-in demo brings its own data"
        batch = DEMO_GLOBAL_BATCH if args.global_batch is None else args.global_batch
        if batch < 1:
            return f"--global-batch {batch}: it must be at least 1"
        if batch % args.devices:
            return f"--global-batch {batch} must be a multiple of --devices {args.devices}"
        return None
    if args.model_size is not None or args.global_batch is not None:
        return "--model-size and --global-batch set up the built-in demo; with --model, your data sets the batch"
    for flag, value in (("--model", args.model), ("--data", args.data)):
        if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
            return f"{flag} {value}: expected MODULE:FACTORY, for example my_models:make_net"
    return None
