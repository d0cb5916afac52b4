"""Plain-text tables, as the comparison command and the cost model print them."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table"]


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
