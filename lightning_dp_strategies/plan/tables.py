"""Plain-text tables: :func:`text_table` (the comparison prints it too) and the cost model's :func:`format_table`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lightning_dp_strategies.plan.model import Prediction

__all__ = ["format_table", "text_table"]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, rule: bool = False) -> str:
    """Fixed-width columns: the first left-aligned, the others right-aligned; ``rule`` draws dashes under the header.

    Examples:
        >>> print(text_table(["name", "ms"], [["ring", "1.5"], ["single", "12.25"]], rule=True))
        name       ms
        ------  -----
        ring      1.5
        single  12.25
    """
    lines = [list(header), *map(list, rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    out = [fmt(line) for line in lines]
    if rule:
        out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_table(predictions: Iterable[Prediction]) -> str:
    """A fixed-width text table of :meth:`Prediction.as_row` rows.

    Examples:
        >>> from lightning_dp_strategies.plan import Link, MiB, Workload, plan
        >>> print(format_table(plan(Workload(gradient_bytes=MiB), Link(1e-5, 1e9), (2, 4), ['ring_allreduce'])))
        strategy        world  S x D  M  MB/rank  msgs/rank  comm_ms  exposed_ms  bubble
        ring_allreduce      2  1 x 2  1    1.049          2    1.069       1.069     0.0
        ring_allreduce      4  1 x 4  1    1.573          6    1.633       1.633     0.0
    """
    rows = [{k: str(v) for k, v in p.as_row().items()} for p in predictions]
    if not rows:
        return ""
    return text_table(list(rows[0]), [list(r.values()) for r in rows])
