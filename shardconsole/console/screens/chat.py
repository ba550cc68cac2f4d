"""The chat screen: talk to a run's model (its newest checkpoint exported through export-model, or an
exported folder), and on request to its base model in a second column, with the same prompt.

The model lives in a child process (console/chat_client.py: the console imports no torch); a thread
worker reads its lines and posts them here as ChatHeard messages, so the UI never waits on loading or
generating. ctrl+c or escape stops an answer, never the app; escape with nothing to stop goes back.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Input, Label, Static

from shardconsole.console.chat_client import ChatProcess
from shardconsole.console.chat_state import Conversation
from shardconsole.console.messages import ChatHeard
from shardconsole.tryout import chat_wire as W
from shardconsole.console.widgets.form_input import FormInput

HERE = Path(__file__).parent
LABELS = {W.RUN: "model", W.BASE: "base"}
# The sampling fields: (id, label, default, parse, rule shown when the value is refused)
FIELDS = (("temperature", "temperature", "0", float, lambda v: v >= 0, "a number ≥ 0 (0: greedy)"),
          ("top-p", "top-p", "1", float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
          ("max-new-tokens", "max new tokens", "256", int, lambda v: v >= 1, "a whole number ≥ 1"))


class ChatScreen(Screen[None]):
    CSS_PATH = HERE / "chat.tcss"
    AUTO_FOCUS = "#prompt"      # one can write the first message while the model loads
    BINDINGS = [
        Binding("escape", "stop_or_back", "Stop / back"),
        # priority: the prompt's Input would take ctrl+c as copy, the app as its quit hint
        Binding("ctrl+c", "stop", "Stop", priority=True, show=False),
        Binding("ctrl+b", "toggle_base", "Base side by side"),
        Binding("ctrl+r", "reset", "New chat"),
    ]

    def __init__(self, target: Path, title: str, *, step: int | None = None, device: str | None = None,
                 base: Path | None = None) -> None:
        """target: a run folder (its checkpoint of `step`, else its newest, is exported on the way) or an
        exported model folder; base: the base model's folder (None: the folder the run started from)."""
        super().__init__()
        # The step in the title: a run keeps several checkpoints, and the user sees which one was picked.
        self.target, self.title_text = Path(target), title if step is None else f"{title}, step {step}"
        self.client = ChatProcess(self.target, step=step, device=device, base=base)
        self.chat = Conversation()
        self.ready: dict[str, str] = {}          # model -> device, once loaded
        self.names: dict[str, str] = {}          # model -> what the child says it loaded (its run and step)
        self.unavailable: dict[str, str] = {}    # model -> why
        self.base_on = False

    def compose(self) -> ComposeResult:
        with Vertical(id="chat-body"):
            yield Label(f"Chat with {self.title_text}", id="chat-title")
            yield Static("starting the chat process…", id="chat-status", markup=False)
            with Horizontal(id="chat-columns"):
                with VerticalScroll(id="col-run", classes="column"):
                    yield Static(Text("the model's answers appear here", style="dim"), id="log-run")
                with VerticalScroll(id="col-base", classes="column"):
                    yield Static("", id="log-base")
            with Horizontal(id="chat-fields"):
                for fid, label, default, *_ in FIELDS:
                    yield Label(label, classes="field-label")
                    yield FormInput(default, id=fid, compact=True, classes="field")
            yield FormInput(placeholder="your message (enter sends)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#col-run").border_title = "the run's model"
        self.query_one("#col-base").border_title = "its base model, the same prompt"
        self.query_one("#col-base").display = False
        self.listen()

    def on_unmount(self) -> None:
        # In a thread: a child still loading a large model is given a few seconds before it is killed.
        threading.Thread(target=self.client.close, name="chat-close", daemon=True).start()

    @work(thread=True, exclusive=True, group="chat")
    def listen(self) -> None:
        """The child's lines, posted one by one; its end, with why."""
        try:
            self.client.start()
        except OSError as e:
            self.post_message(ChatHeard(ended=f"the chat process did not start: {e}"))
            return
        for event in self.client.heard():
            self.post_message(ChatHeard(event))
        self.post_message(ChatHeard(ended=self.client.why_ended()))

    # --- what the child says ----------------------------------------------------------------------

    @on(ChatHeard)
    def _heard(self, message: ChatHeard) -> None:
        ev = message.event
        if message.ended:
            for model in self.chat.answering():
                self.chat.done(model, stopped=False, error="the chat process ended")
            if W.RUN not in self.unavailable:
                self.unavailable[W.RUN] = message.ended
        elif isinstance(ev, W.Loading):
            self._status(ev.text + " …")
        elif isinstance(ev, W.Ready):
            self.ready[ev.model], self.names[ev.model] = ev.device, ev.name
        elif isinstance(ev, W.Unavailable):
            self.unavailable[ev.model] = ev.text
        elif isinstance(ev, W.Piece):
            self.chat.piece(ev.model, ev.text)
        elif isinstance(ev, W.Done):
            self.chat.done(ev.model, ev.stopped, ev.error)
        if not isinstance(ev, W.Loading):
            self._refresh()

    def _refresh(self) -> None:
        self._status(self._status_line())
        self.query_one("#chat-status").set_class(W.RUN in self.unavailable, "-error")
        self.query_one("#prompt", Input).disabled = W.RUN in self.unavailable
        for model, label in LABELS.items():
            why = self.unavailable.get(model) if model == W.BASE else None
            text = Text(why + "\n\n", style="yellow") if why else Text()
            if self.chat.turns:
                text.append_text(self.chat.column(model, label))
            if text:
                self.query_one(f"#log-{model}", Static).update(text)
                self.query_one(f"#col-{model}", VerticalScroll).scroll_end(animate=False)

    def _status_line(self) -> str:
        if W.RUN in self.unavailable:
            return self.unavailable[W.RUN]
        if W.RUN not in self.ready:
            return "starting the chat process…"
        # The child's own name for what it loaded ("<run>, step N"; an export's folder name), not ours.
        line = f"{self.names.get(W.RUN) or LABELS[W.RUN]} on {self.ready[W.RUN]}"
        if self.base_on:
            base = ("not there (see its column)" if W.BASE in self.unavailable else
                    f"on {self.ready[W.BASE]}" if W.BASE in self.ready else "loading…")
            line += f"; base {base}"
        if self.chat.answering():
            line += "; answering (ctrl+c or escape stops)"
        return line

    def _status(self, text: str) -> None:
        self.query_one("#chat-status", Static).update(text)

    # --- what the user does -------------------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    def _send(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if W.RUN not in self.ready:
            self.notify("the model is still loading: enter sends once it is ready", severity="warning")
            return
        if self.chat.answering():
            self.notify("an answer is still coming: ctrl+c stops it", severity="warning")
            return
        sampling = self._sampling()
        if sampling is None:
            return
        models = [W.RUN] + ([W.BASE] if self.base_on and W.BASE not in self.unavailable else [])
        prompt = self.chat.ask(text, models)
        for model in models:        # the child answers in order: the run's model, then the base
            self.client.send(W.Ask(model, prompt, **sampling))
        event.input.value = ""
        self._refresh()

    @on(Input.Submitted, ".field")
    def _field_done(self) -> None:
        self.query_one("#prompt", Input).focus()

    def _sampling(self) -> dict | None:
        """The fields' values, or None with one line naming the field that is wrong and what it takes."""
        values = {}
        for fid, label, _default, parse, ok, rule in FIELDS:
            text = self.query_one(f"#{fid}", Input).value.strip()
            try:
                value = parse(text)
                if not ok(value):
                    raise ValueError
            except ValueError:
                self.notify(f"{label}: {text!r} is not {rule}", severity="error")
                return None
            values[fid.replace("-", "_")] = value
        return values

    def action_stop(self) -> None:
        if self.chat.answering():
            self.client.send(W.Stop())

    def action_stop_or_back(self) -> None:
        if self.chat.answering():
            self.client.send(W.Stop())
        else:
            self.dismiss(None)

    def action_toggle_base(self) -> None:
        self.base_on = not self.base_on
        self.query_one("#col-base").display = self.base_on
        if self.base_on and W.BASE not in self.ready and W.BASE not in self.unavailable:
            self.client.send(W.Load(W.BASE))
        self._refresh()

    def action_reset(self) -> None:
        if self.chat.answering():
            self.notify("an answer is still coming: ctrl+c stops it first", severity="warning")
            return
        self.chat = Conversation()
        self.query_one("#log-run", Static).update(Text("a new conversation", style="dim"))
        self.query_one("#log-base", Static).update("")
        self._refresh()
