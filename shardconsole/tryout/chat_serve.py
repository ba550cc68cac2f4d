"""The chat process behind the console's chat screen (`shardconsole chat TARGET --serve`): the run's model,
and its base on request, answering chat_wire requests from stdin with streamed pieces on stdout.

One thread reads stdin, so a Stop arrives while an answer streams; the main thread loads, generates and
is the only writer of stdout. Every Ask carries its own stop event: a Stop sets the events of every
request received so far, so the answer under way ends between two tokens and the queued ones end
unanswered, while a request sent after the Stop is answered.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import TextIO, cast

from shardconsole.settings import config as C
from shardconsole.tryout import chat_wire as W
from shardconsole.tryout.base import Base
from shardconsole.settings.values import format_size
from shardconsole.tryout.chat import ChatModel, Sampling, weights_bytes


class Requests:
    """stdin's requests, each with its stop event; None in the queue: stdin ended (the console is gone)."""

    def __init__(self, inp: TextIO) -> None:
        self.queue: queue.Queue[tuple[W.Wire, threading.Event] | None] = queue.Queue()
        self._unanswered: list[threading.Event] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, args=(inp,), name="chat-requests", daemon=True).start()

    def _read(self, inp: TextIO) -> None:
        for line in inp:
            if not line.strip():
                continue
            try:
                msg = W.decode(line)
            except W.WireError:
                continue            # the console wrote it, so it is ours to fix; never a crash mid-chat
            with self._lock:
                if isinstance(msg, W.Stop):
                    for ev in self._unanswered:
                        ev.set()
                    self._unanswered.clear()
                    continue
                ev = threading.Event()
                self._unanswered.append(ev)
            self.queue.put((msg, ev))
        self.queue.put(None)

    def answered(self, ev: threading.Event) -> None:
        with self._lock:
            if ev in self._unanswered:
                self._unanswered.remove(ev)


class Server:
    def __init__(self, folder: Path, base: Base | None, device: str | None, out: TextIO, name: str) -> None:
        self.folder, self.base, self.device, self.out, self.name = folder, base, device, out, name
        self.models: dict[str, ChatModel | str] = {}      # a loaded model, or why it cannot be had

    def say(self, msg: W.Wire) -> None:
        self.out.write(W.encode(msg))
        self.out.flush()

    def model(self, which: str) -> ChatModel | str:
        if which not in self.models:
            self.models[which] = self._load(which)
        return self.models[which]

    def _load(self, which: str) -> ChatModel | str:
        if which == W.BASE and (self.base is None or self.base.folder is None):
            why = self.base.why if self.base is not None else "no base model was asked for"
            self.say(W.Unavailable(which, why))
            return why
        # which is RUN or BASE (the console asks for no other): for BASE, base and its folder are checked above
        folder = cast(Path, self.folder if which == W.RUN else self.base.folder)    # type: ignore[union-attr]
        try:
            need = weights_bytes(folder)
            self.say(W.Loading(which, f"loading {folder} ({format_size(need)} of weights in bf16)"))
            model = ChatModel(folder, self.device, tokenizer_from=self.folder if which == W.BASE else None)
        except C.ConfigError as e:
            self.say(W.Unavailable(which, str(e)))
            return str(e)
        except Exception as e:          # a folder transformers cannot load: said, the chat goes on
            why = f"chat: {folder}: {type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
            self.say(W.Unavailable(which, why))
            return why
        # a run trained on plain-text prompts is chatted with in plain text: the console says so by its name
        plain = ", prompts as plain text (as trained)" if model.trained_raw and which == W.RUN else ""
        self.say(W.Ready(which, model.device, (self.name + plain) if which == W.RUN else str(folder)))
        return model

    def answer(self, ask: W.Ask, stop: threading.Event) -> None:
        if stop.is_set():
            self.say(W.Done(ask.model, stopped=True))
            return
        model = self.model(ask.model)
        if isinstance(model, str):
            self.say(W.Done(ask.model, error=model))
            return
        try:
            sampling = Sampling(ask.temperature, ask.top_p, ask.max_new_tokens).check("chat")
            for piece in model.reply(ask.messages, sampling, stop):
                if piece:
                    self.say(W.Piece(ask.model, piece))
        except C.ConfigError as e:
            self.say(W.Done(ask.model, error=str(e)))
            return
        except Exception as e:          # generation failed (out of memory, ...): one line, the chat goes on
            self.say(W.Done(ask.model, error=f"{type(e).__name__}: {str(e).strip()[:160]}"))
            return
        self.say(W.Done(ask.model, stopped=stop.is_set()))


def serve(folder: Path, base: Base | None, device: str | None, inp: TextIO, out: TextIO, name: str) -> int:
    """Load the run's model, then answer requests until stdin ends. Returns 0, or 1 if the run's model
    could not be loaded (the console has its Unavailable line)."""
    requests = Requests(inp)
    server = Server(folder, base, device, out, name)
    if isinstance(server.model(W.RUN), str):
        return 1
    while (item := requests.queue.get()) is not None:
        msg, ev = item
        if isinstance(msg, W.Load):
            server.model(msg.model)
        elif isinstance(msg, W.Ask):
            server.answer(msg, ev)
        requests.answered(ev)
    return 0
