"""A Log that follows its newest line (the run screen's Logs panel)."""

from __future__ import annotations

from textual.widgets import Log


class FollowingLog(Log):
    """A Log that keeps to its newest line until the user scrolls up, and again once they scroll back
    down. Log's own auto_scroll lost the end for good when lines came before the first layout or many
    at once (it scrolls before the new lines are laid out), and the panel then showed the oldest lines."""

    following = True

    def add(self, lines: list[str]) -> None:
        self.write_lines(lines, scroll_end=False)
        if self.following:
            # force: the scrollbar that allows the scroll appears only at the next layout
            self.scroll_end(animate=False, force=True)

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if self.size.height and new_value != old_value:    # moved: by the user, or by scroll_end
            self.following = new_value >= self.max_scroll_y

    def on_resize(self) -> None:
        if self.following:
            self.scroll_end(animate=False, force=True)

    def watch_show_vertical_scrollbar(self, shown: bool) -> None:
        # Textual moves the scrollbar's thumb only while the bar is shown: the forced scroll_end above
        # runs before the bar appears, which then drew its thumb at the top while the panel showed the end.
        if shown:
            self.vertical_scrollbar.position = self.scroll_y
