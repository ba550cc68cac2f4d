"""A chat screen's conversation, without Textual: the turns, the answers as they stream, what each column
shows. The run's model carries the conversation (its answers are the assistant's turns); the base, when
asked, answers each message given the very same prompt, so a column beside it shows what training changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.text import Text

from shardconsole.tryout import chat_wire as W


def printable(text: str) -> str:
    """A model's text as a terminal can draw it: a control character (an untrained model makes them)
    would move the cursor or ring the bell, so it shows as �."""
    return "".join(c if c == "\n" or c.isprintable() else "�" for c in text)


@dataclass
class Answer:
    text: str = ""
    done: bool = False
    stopped: bool = False
    error: str = ""


@dataclass
class Turn:
    user: str
    answers: dict[str, Answer] = field(default_factory=dict)     # W.RUN, W.BASE (when asked)


@dataclass
class Conversation:
    system: str = ""
    turns: list[Turn] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        """The prompt of the last turn: every earlier turn with the run's answer, then the last message."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for turn in self.turns:
            out.append({"role": "user", "content": turn.user})
            run = turn.answers.get(W.RUN)
            if run is not None and run.done and not run.error and turn is not self.turns[-1]:
                out.append({"role": "assistant", "content": run.text})
        return out

    def ask(self, text: str, models: list[str]) -> list[dict[str, str]]:
        self.turns.append(Turn(text, {m: Answer() for m in models}))
        return self.messages()

    def answering(self) -> list[str]:
        """The models whose answer to the last message is still coming."""
        last = self.turns[-1] if self.turns else None
        return [m for m, a in last.answers.items() if not a.done] if last else []

    def piece(self, model: str, text: str) -> None:
        answer = self._current(model)
        if answer is not None:
            answer.text += text

    def done(self, model: str, stopped: bool, error: str) -> None:
        answer = self._current(model)
        if answer is not None:
            answer.done, answer.stopped, answer.error = True, stopped, error

    def _current(self, model: str) -> Answer | None:
        return self.turns[-1].answers.get(model) if self.turns else None

    def column(self, model: str, label: str) -> Text:
        """What one column shows: each message, and `model`'s answer to it."""
        t = Text()
        for turn in self.turns:
            t.append("you  ", style="bold cyan")
            t.append(turn.user + "\n")
            answer = turn.answers.get(model)
            t.append(f"{label}  ", style="bold green" if model == W.RUN else "bold magenta")
            if answer is None:
                t.append("(not asked)\n\n", style="dim")
                continue
            t.append(printable(answer.text))
            if answer.error:
                t.append(f" [{answer.error}]", style="red")
            elif answer.stopped:
                t.append(" [stopped]", style="yellow")
            elif not answer.done:
                t.append("▍", style="dim")
            elif not answer.text:       # else an empty line reads as a chat that hangs
                t.append("(nothing: the model ended its turn at once)", style="dim")
            t.append("\n\n")
        return t
