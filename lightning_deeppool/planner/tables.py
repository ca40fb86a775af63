"""Aligned text tables, as the planner prints plans and projections."""

from __future__ import annotations

from collections.abc import Sequence


def aligned(rows: Sequence[Sequence[str]], *, left: int = 0) -> list[str]:
    """One line per row: every column as wide as its widest cell, two spaces apart, the first `left`
    columns left-aligned and the others right-aligned; no trailing spaces."""
    sizes = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(size) if i < left else cell.rjust(size)
            for i, (cell, size) in enumerate(zip(row, sizes, strict=True))
        ).rstrip()
        for row in rows
    ]
