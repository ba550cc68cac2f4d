"""What the console and its chat process (`shardconsole chat TARGET --serve`) say to each other: one JSON
object a line, on the child's stdin and stdout. Standard library only, so the console (which imports no
torch or transformers) and the child read the same definitions.

Why a child process: the console never loads torch, and a model's memory goes back to the machine
when its chat screen closes. The child answers one request at a time, in order; `Stop` ends the
generation under way and drops the requests still queued behind it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

RUN, BASE = "run", "base"       # which model a request or an answer is about


@dataclass(frozen=True)
class Ask:
    """console -> child: answer this conversation with `model` (RUN or BASE)."""
    model: str
    messages: list[dict[str, str]] = field(default_factory=list)
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    kind: str = "ask"


@dataclass(frozen=True)
class Load:
    """console -> child: load `model` now (the base, when the user asks for it beside the run)."""
    model: str
    kind: str = "load"


@dataclass(frozen=True)
class Stop:
    """console -> child: end the current generation between two tokens, drop the queued ones."""
    kind: str = "stop"


@dataclass(frozen=True)
class Loading:
    """child -> console: what the child is doing before a model is ready (exporting, loading)."""
    model: str
    text: str
    kind: str = "loading"


@dataclass(frozen=True)
class Ready:
    """child -> console: `model` is loaded on `device`; `name` says what it is."""
    model: str
    device: str
    name: str
    kind: str = "ready"


@dataclass(frozen=True)
class Unavailable:
    """child -> console: `model` cannot be had (memory, no checkpoint, a random base): one line why."""
    model: str
    text: str
    kind: str = "unavailable"


@dataclass(frozen=True)
class Piece:
    """child -> console: the next piece of `model`'s answer."""
    model: str
    text: str
    kind: str = "piece"


@dataclass(frozen=True)
class Done:
    """child -> console: `model`'s answer ended; stopped: by a Stop, not by itself."""
    model: str
    stopped: bool = False
    error: str = ""
    kind: str = "done"


Wire = Ask | Load | Stop | Loading | Ready | Unavailable | Piece | Done
KINDS: dict[str, type] = {c.kind: c for c in (Ask, Load, Stop, Loading, Ready, Unavailable, Piece, Done)}


class WireError(ValueError):
    pass


def encode(msg: Wire) -> str:
    return json.dumps(asdict(msg), ensure_ascii=False) + "\n"


def decode(line: str) -> Wire:
    try:
        raw = json.loads(line)
        cls = KINDS[raw["kind"]]
    except (ValueError, KeyError, TypeError) as e:
        raise WireError(f"not a chat message: {line[:80]!r}") from e
    known = {f.name for f in fields(cls)}
    try:
        return cls(**{k: v for k, v in raw.items() if k in known})
    except TypeError as e:
        raise WireError(f"a {raw['kind']} message without its fields: {line[:80]!r}") from e
