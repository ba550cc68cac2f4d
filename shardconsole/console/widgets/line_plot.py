"""LinePlot: a small braille line plot (2x4 dots a cell) with its min/max in the left margin."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.style import Style
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

# Bit of each dot in a braille cell, by [row][column] (Unicode's braille patterns, U+2800).
END_OF_ROW = "end of row"     # a colour no cell has: the last run of a row ends there
_DOTS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))


@dataclass(frozen=True)
class PlotSeries:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str = "#5fd7d7"


class LinePlot(Widget):
    """Series drawn as braille lines, the y range in the left margin. Set `series` to redraw."""

    DEFAULT_CSS = """
    LinePlot {
        height: 5;
        min-height: 2;
        width: 1fr;
    }
    LinePlot > .line-plot--axis {
        color: $text-muted;
    }
    """
    COMPONENT_CLASSES = {"line-plot--axis"}

    series: reactive[tuple[PlotSeries, ...]] = reactive((), always_update=True, layout=False)

    def __init__(self, *, empty: str = "waiting for data", fmt: Callable[[float], str] | None = None,
                 y_min: float | None = None, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        """y_min: a floor for the scale (0 for memory, so a small change does not look like a cliff)."""
        super().__init__(name=name, id=id, classes=classes)
        self.empty = empty
        self.fmt = fmt or (lambda v: f"{v:.3g}")
        self.y_min = y_min

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        points = [s for s in self.series if len(s.xs) > 0]
        if not points or width < 8 or height < 1:
            return Text(self.empty, style="dim", overflow="ellipsis", no_wrap=True)
        lo = min(min(s.ys) for s in points)
        hi = max(max(s.ys) for s in points)
        if self.y_min is not None:
            lo = min(lo, self.y_min)
        if hi - lo < 1e-12 * max(1.0, abs(hi)):
            lo, hi = lo - 0.5 * (abs(lo) or 1.0), hi + 0.5 * (abs(hi) or 1.0)
        x0 = min(s.xs[0] for s in points)
        x1 = max(s.xs[-1] for s in points)
        labels = [self.fmt(hi), self.fmt(lo)]
        margin = max(len(x) for x in labels) + 1
        cols = max(1, width - margin)
        dots_w, dots_h = cols * 2, height * 4
        cells = [[0] * cols for _ in range(height)]
        colors: list[list[str | None]] = [[None] * cols for _ in range(height)]

        def dot_y(v: float) -> int:
            return max(0, min(dots_h - 1, round((hi - v) / (hi - lo) * (dots_h - 1))))

        def dot_x(v: float) -> int:
            return 0 if x1 == x0 else max(0, min(dots_w - 1, round((v - x0) / (x1 - x0) * (dots_w - 1))))

        def mark(dx: int, dy: int, color: str) -> None:
            row, col = dy // 4, dx // 2
            cells[row][col] |= _DOTS[dy % 4][dx % 2]
            colors[row][col] = color

        for s in points:
            pts = [(dot_x(x), dot_y(y)) for x, y in zip(s.xs, s.ys)]
            mark(*pts[0], s.color)
            for (ax, ay), (bx, by) in zip(pts, pts[1:]):
                # Walk the segment a dot column at a time; in each column fill from the line's height here
                # to its height at the next column, so steep stretches stay connected.
                run = bx - ax
                for dx in range(ax, bx + 1):
                    here = ay + (by - ay) * (dx - ax) / run if run else ay
                    there = ay + (by - ay) * min(dx + 1 - ax, run) / run if run else by
                    a, b = sorted((round(here), round(there)))
                    for dy in range(a, b + 1):
                        mark(dx, dy, s.color)
        axis = self.get_component_rich_style("line-plot--axis")
        styles = {s.color: Style(color=s.color) for s in points}
        text = Text(no_wrap=True, overflow="crop")
        for row in range(height):
            label = labels[0] if row == 0 else labels[1] if row == height - 1 else ""
            text.append(label.rjust(margin - 1) + " ", axis)
            # One span per run of a colour: a plot redraws several times a second.
            line, run_color, start = cells[row], colors[row][0], 0
            for col in range(1, cols + 1):
                color = colors[row][col] if col < cols else END_OF_ROW
                if color != run_color:
                    chunk = "".join(chr(0x2800 + bits) for bits in line[start:col])
                    text.append(chunk, styles.get(run_color) if run_color else None)
                    run_color, start = color, col
            if row < height - 1:
                text.append("\n")
        return text
