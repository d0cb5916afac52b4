"""The ``lightning-dp-strategies`` command (also ``python -m lightning_dp_strategies``)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-dp-strategies", description="Data-parallel Lightning strategies.")
    commands = parser.add_subparsers(dest="command", required=True)
    cmp = commands.add_parser(
        "compare",
        help="train a built-in demo with each strategy and compare them side by side",
        description="Train the built-in demo (synthetic data, an MLP) with each strategy on the same global batches,"
        " then print a table and write comparison.json and comparison.png.",
    )
    cmp.add_argument("--strategies", help="comma-separated names (default: single,dp,ring_allreduce,ddp,...)")
    cmp.add_argument("--devices", type=int, default=2, help="devices or processes per strategy (default 2)")
    cmp.add_argument("--steps", type=int, default=30, help="optimizer steps per strategy (default 30)")
    cmp.add_argument(
        "--model-size",
        choices=["small", "medium", "large"],
        default="medium",
        help="demo MLP: small ~0.07 M, medium ~1.4 M, large ~21 M parameters (default medium)",
    )
    cmp.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step, all ranks (default 64)")
    cmp.add_argument("--output", type=Path, default=Path("comparison"), help="output folder (default ./comparison)")
    cmp.add_argument("--seed", type=int, default=0)
    cmp.add_argument("--timeout", type=float, default=300.0, help="seconds before one strategy's run is abandoned")
    cmp.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (it may register more strategy names); repeatable",
    )
    cmp.add_argument("--worker", help=argparse.SUPPRESS)
    cmp.add_argument("--config-json", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 when every strategy ran)."""
    parser = _parser()
    args = parser.parse_args(argv)
    for module in args.imports:
        try:
            importlib.import_module(module)
        except ImportError as err:
            parser.error(f"--import {module}: {err}")

    import lightning_dp_strategies  # noqa: F401  (registers the strategy names)
    from lightning_dp_strategies.compare import demo, report, runner

    if args.worker:
        config = demo.DemoConfig(**json.loads(args.config_json))
        runner.run_worker(args.worker, config, args.devices, args.output)
        return 0

    names = args.strategies.split(",") if args.strategies else runner.default_strategies()
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in runner.available_strategies()]
    if unknown:
        ours = [n for n in runner.default_strategies()]
        parser.error(
            f"unknown strategy {', '.join(map(repr, unknown))}. Available: {', '.join(ours)}"
            f" (and any registered name: {', '.join(runner.available_strategies())})"
        )
    if args.devices < 1 or args.steps < 1:
        parser.error("--devices and --steps must be at least 1")
    if args.global_batch % args.devices:
        parser.error(f"--global-batch {args.global_batch} must be a multiple of --devices {args.devices}")
    config = demo.DemoConfig(
        steps=args.steps, global_batch=args.global_batch, model_size=args.model_size, seed=args.seed
    )
    start = time.perf_counter()
    print(f"Comparing {len(names)} strategies on {args.devices} CPU devices/processes: {config}", flush=True)
    results = runner.compare(
        names, config, args.devices, args.output, args.timeout, args.imports, lambda m: print(m, flush=True)
    )
    print()
    print(report.format_table(results))
    report.write_json(results, config, args.devices, args.output / "comparison.json")
    wrote_png = report.write_figure(results, args.output / "comparison.png")
    print(
        f"\nwrote {args.output / 'comparison.json'}"
        + (f" and {args.output / 'comparison.png'}" if wrote_png else " (no PNG: pip install matplotlib)")
        + f" in {time.perf_counter() - start:.0f} s"
    )
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
