"""SettingField: one setting of a TOML table as a row: name, the widget its type calls for, and a note.

The widget follows the FieldSpec (console/fields.py): Select for a choice, Switch for a flag, an Input
(FormInput: keys in the order typed) for numbers, sizes and text. The row does not judge its value; it posts Edited with the text, and the
screen (which knows the whole config) sets `error` back: attributes down, messages up.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Input, Label, Select, Static, Switch

from shardconsole.console.fields import FieldSpec
from shardconsole.console.widgets.form_input import FormInput


class FieldSelect(Select[str], inherit_bindings=False):
    """A Select that opens with enter or space: up and down move between the form's fields, as in
    every other row (Select opens on them too). In the open list they still move the highlight."""

    BINDINGS = [Binding("enter,space", "show_overlay", "Show menu", show=False)]


class SettingField(Widget):
    BINDINGS = [
        Binding("up", "neighbour(-1)", "Previous field", show=False),
        Binding("down", "neighbour(1)", "Next field", show=False),
    ]
    DEFAULT_CSS = """
    SettingField {
        layout: horizontal;
        height: auto;
        padding: 0 1;
        &:focus-within { background: $boost; }
        & > .setting--name { width: 26; height: 1; text-overflow: ellipsis; text-wrap: nowrap; }
        &.-changed > .setting--name { color: $accent; text-style: bold; }
        & > .setting--control { width: 22; height: 1; }
        /* text (paths, names): room for a path, not 22 characters of one */
        &.-text > .setting--control { width: 48; }
        & > Switch.setting--control {
            border: none; padding: 0; width: 6; background: $panel-darken-1;
            & > .switch--slider { color: $foreground-darken-3; background: $panel-darken-1; }
            &.-on > .switch--slider { color: $success; }
            &:focus > .switch--slider { color: $accent; }
            &.-on:focus > .switch--slider { color: $success-lighten-2; }
        }
        & > .setting--note {
            width: 1fr; height: auto; max-height: 1; margin-left: 1;
            color: $text-muted; text-wrap: nowrap; text-overflow: ellipsis;
        }
        &.-invalid > .setting--note { color: $text-error; max-height: 4; text-wrap: wrap; }
        &.-invalid > Input.setting--control { background: $error 25%; }
    }
    .-narrow SettingField {
        & > .setting--name { width: 22; }
        & > .setting--control { width: 18; }
        &.-text > .setting--control { width: 34; }
    }
    """

    error: reactive[str] = reactive("")
    """What config.py says is wrong with the value (shown in place of the note)."""
    changed: reactive[bool] = reactive(False)
    """The value differs from the preset's."""
    hint: reactive[str] = reactive("")
    """A reading aid after the widget, such as '= 24.0 GiB'."""

    @dataclass
    class Edited(Message):
        setting: "SettingField"
        text: str

        @property
        def control(self) -> "SettingField":
            return self.setting

    def __init__(self, spec: FieldSpec, text: str, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="-text" if spec.kind == "text" else None)
        self.spec = spec
        self._text = text

    def compose(self) -> ComposeResult:
        spec = self.spec
        yield Label(("● " if self.changed else "") + spec.key, classes="setting--name")
        if spec.kind == "select":
            yield FieldSelect([(c, c) for c in spec.choices], value=self._text, allow_blank=False, compact=True,
                              classes="setting--control")
        elif spec.kind == "switch":
            yield Switch(value=self._text == "true", classes="setting--control")
        else:
            placeholder = "default" if spec.optional else ("e.g. 24GiB" if spec.kind == "size" else "")
            yield FormInput(self._text, placeholder=placeholder, compact=True, classes="setting--control",
                        select_on_focus=False)
        yield Static(self._note(), classes="setting--note", markup=False)

    def action_neighbour(self, offset: int) -> None:
        """Focus the control of the field above (-1) or below (+1) in this form; stay at either end."""
        rows = [w for w in self.parent.children if isinstance(w, SettingField) and w.display] if self.parent else []
        at = rows.index(self) + offset if self in rows else -1
        if 0 <= at < len(rows):
            rows[at].query_one(".setting--control").focus()
            rows[at].scroll_visible()

    @property
    def text(self) -> str:
        return self._text

    def set_text(self, text: str) -> None:
        """Show a value chosen elsewhere (a preset was loaded) without posting Edited."""
        self._text = text
        if not self.is_mounted:
            return
        control = self.query_one(".setting--control")
        with self.prevent(Select.Changed, Switch.Changed, Input.Changed):
            if isinstance(control, Select):
                control.value = text
            elif isinstance(control, Switch):
                control.value = text == "true"
            elif isinstance(control, Input):
                control.value = text

    def _note(self) -> str:
        if self.error:
            return self.error
        return "  ".join(x for x in (self.hint, self.spec.help) if x)

    def _update_note(self) -> None:
        if self.is_mounted:
            self.query_one(".setting--note", Static).update(self._note())

    def watch_error(self, error: str) -> None:
        self.set_class(bool(error), "-invalid")
        self._update_note()

    def watch_hint(self) -> None:
        self._update_note()

    def watch_changed(self, changed: bool) -> None:
        self.set_class(changed, "-changed")
        if self.is_mounted:
            self.query_one(".setting--name", Label).update(("● " if changed else "") + self.spec.key)

    def _edited(self, text: str) -> None:
        if text == self._text:
            return   # a widget reporting the value it was given (Select and Switch do on mount)
        self._text = text
        self.post_message(self.Edited(self, text))

    @on(Select.Changed)
    def _select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self._edited(str(event.value))

    @on(Switch.Changed)
    def _switch_changed(self, event: Switch.Changed) -> None:
        event.stop()
        self._edited("true" if event.value else "false")

    @on(Input.Changed)
    def _input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._edited(event.value)
