"""The ``lightning-dp-strategies`` command (also ``python -m lightning_dp_strategies``).

The parser (:mod:`.parser`) imports no torch, so ``--help`` answers at once; :mod:`.run` runs a checked command.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_dp_strategies.cli.parser import check, parser

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 when every strategy ran)."""
    cli = parser()
    args = cli.parse_args(argv)
    problem = check(args)
    if problem:
        cli.error(problem)
    from lightning_dp_strategies.cli.run import run  # imports torch and Lightning: only for a command that will run

    return run(args, cli)
