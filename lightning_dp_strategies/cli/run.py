"""Running a checked ``compare`` command: one strategy's worker, or the whole comparison and its report."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dp_strategies.compare.demo import DemoConfig

from lightning_dp_strategies.compare.spec import DEMO_GLOBAL_BATCH


def _listing(out: Path, kept: bool, wrote_png: bool) -> list[str]:
    logs = sorted((out / "logs").glob("*.log"))
    lines = [f"wrote to {out}/:", "  comparison.json  every figure and curve, the configuration and the machine"]
    lines.append("  comparison.png   the figure" if wrote_png else "  (no comparison.png: pip install matplotlib)")
    lines.append(f"  logs/            each strategy's output ({len(logs)} files)")
    if kept:
        kept_files = len(list((out / "checkpoints").glob("*.ckpt")))
        lines.append(f"  checkpoints/     each strategy's final checkpoint ({kept_files} files)")
    else:
        lines.append("  (checkpoints are not kept: pass --keep-checkpoints to keep them)")
    return lines


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run a checked ``compare`` command: the worker of one strategy (``--worker``), or the whole comparison."""
    if os.getcwd() not in sys.path:  # as `python -m` does, and as for --model: modules beside the user are importable
        sys.path.insert(0, os.getcwd())
    for module in args.imports:
        try:
            importlib.import_module(module)
        except ImportError as err:
            parser.error(f"--import {module}: {err}")

    import lightning  # noqa: F401  (importing Lightning registers the package's strategy names)

    from lightning_dp_strategies.compare import demo, runner, worker

    if args.worker:
        worker.run_worker(args.worker, args.task, args.devices, args.output)
        return 0

    config = None
    if args.model is None:
        config = demo.DemoConfig(
            steps=args.steps,
            global_batch=args.global_batch or DEMO_GLOBAL_BATCH,
            model_size=args.model_size or "medium",
            seed=args.seed,
        )
    names = args.strategies.split(",") if args.strategies else None
    start = time.perf_counter()
    try:
        results = runner.compare(
            names,
            config,
            args.devices,
            args.output,
            args.timeout,
            args.imports,
            lambda m: print(m, flush=True),
            model=args.model,
            train_dataloaders=args.data,
            steps=args.steps,
            seed=args.seed,
            precision=args.precision,
            accelerator=args.accelerator,
            keep_checkpoints=args.keep_checkpoints,
        )
    except ValueError as err:  # every bad value is found before any process starts
        parser.error(str(err))
    _report(args, results, config)
    print(f"in {time.perf_counter() - start:.0f} s")
    return 0 if all(r.status == "ok" for r in results) else 1


def _report(args: argparse.Namespace, results: list[Any], config: DemoConfig | None) -> None:
    """Print the table, write the JSON and the figure, and list what was written."""
    from lightning_dp_strategies.compare import report

    print()
    print(report.format_table(results))
    workload = config or {
        "model": args.model,
        "data": args.data or "the model's train_dataloader",
        "steps": args.steps,
        "seed": args.seed,
        "precision": args.precision,
        "accelerator": args.accelerator,
    }
    report.write_json(results, workload, args.devices, args.output / "comparison.json")
    wrote_png = report.write_figure(results, args.output / "comparison.png")
    print()
    print("\n".join(_listing(args.output, args.keep_checkpoints, wrote_png)))
