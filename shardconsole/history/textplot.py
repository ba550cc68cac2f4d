"""Curves of several runs overlaid in plain text, for `shardconsole compare` (no plotting dependency).

Each run gets a marker; where two runs fall on one cell the later one's marker shows. The x axis is
the step, the y axis is labelled with its range at the top and the bottom.
"""

from __future__ import annotations

import math

MARKERS = "*o+x#@%&"


def overlay(title: str, series: list[tuple[str, list[tuple[int, float]]]], width: int = 72,
            height: int = 12, fmt: str = ".4g") -> list[str]:
    """Lines of a plot: the title, `height` rows of the grid with y labels, the x axis, a legend."""
    points = [(x, y) for _, pts in series for x, y in pts if math.isfinite(y)]
    if not points:
        return [f"{title}: no values"]
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if y1 == y0:
        y0, y1 = y0 - abs(y0) * 0.05 - 1e-9, y1 + abs(y1) * 0.05 + 1e-9
    labels = [format(y1, fmt), format(y0, fmt)]
    pad = max(len(t) for t in labels)
    cols = max(10, width - pad - 3)
    grid = [[" "] * cols for _ in range(height)]
    for i, (_, pts) in enumerate(series):
        mark = MARKERS[i % len(MARKERS)]
        cells = [(0 if x1 == x0 else round((x - x0) / (x1 - x0) * (cols - 1)),
                  (y1 - y) / (y1 - y0) * (height - 1)) for x, y in pts if math.isfinite(y)]
        for (ca, ra), (cb, rb) in zip(cells, cells[1:]):
            # The columns between two values get the line between them, so a sparse log still reads as a curve.
            for c in range(ca + 1, cb):
                grid[round(ra + (rb - ra) * (c - ca) / (cb - ca))][c] = mark
        for c, r in cells:
            grid[round(r)][c] = mark
    out = [title]
    for r, row in enumerate(grid):
        label = labels[0] if r == 0 else labels[1] if r == height - 1 else ""
        out.append(f"{label:>{pad}} |{''.join(row)}")
    out.append(f"{'':>{pad}} +{'-' * cols}")
    left, right = f"step {x0}", f"step {x1}"
    out.append(f"{'':>{pad}}  {left}{right:>{max(1, cols - len(left))}}")
    out.append("  ".join(f"{MARKERS[i % len(MARKERS)]} {name}" for i, (name, _) in enumerate(series)))
    return out
