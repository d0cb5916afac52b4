"""The ``lightning-dp-strategies`` command (also ``python -m lightning_dp_strategies``).

The parser (:mod:`.parser`) answers ``--help``, ``--version`` and wrong values before anything runs; :mod:`.run`
runs a checked command. Like any import of the package, starting the command imports Lightning and registers the
strategy names.
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
    from lightning_dp_strategies.cli.run import run  # the comparison's machinery: only for a command that will run

    return run(args, cli)
