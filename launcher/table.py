"""The one table helper: columns padded to their widest cell, two spaces apart, no trailing blanks."""
from __future__ import annotations


def table(rows: list[tuple], right: tuple[int, ...] = ()) -> str:
    """`rows[0]` is the header. Columns in `right` (numbers) are right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(max(map(len, cells)))]
    lines = []
    for r in cells:
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip())
    return "\n".join(lines)
