"""Plan for a card, as `shardconsole plan --card NAME` does (issue 65 item 8): on a machine without a
GPU (or with another one) the setup screen's "Plan for" choice gives the estimate and the speed of the
run on that card with this host, where it showed the CPU run alone and no speed or time at all.

The console's side of the planner, no Textual here: the card table is plan/speed/cards.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardconsole.settings import config as C

THIS_MACHINE = "machine"     # the choice that plans this machine's own GPUs (or its CPU)


def card_choices() -> list[tuple[str, str]]:
    """(what the list shows, value): this machine first, then every card the speed model knows."""
    from shardconsole.plan.speed.cards import CARDS
    return [("this machine", THIS_MACHINE)] + [(c.title, c.name) for c in CARDS.values()]


def card_title(name: str) -> str:
    from shardconsole.plan.speed.cards import CARDS
    return CARDS[name].title if name in CARDS else name


def with_card(hw: Any, name: str, cfg: C.RunConfig) -> Any:
    """plan's Hardware with the card's GPUs in place of this machine's (as many as this machine has, else
    as many as the run's ranks per node), keeping this host."""
    from shardconsole.plan.speed.cards import CARDS
    card = CARDS.get(name)
    if hw is None or card is None:
        return hw
    return dataclasses.replace(hw, gpus=hw.gpus or max(1, cfg.parallel.nproc_per_node),
                               gpu_memory_bytes=card.memory_bytes, gpu_name=card.title,
                               source=f"{hw.source}, card {card.name}")


def speed_text(cfg: C.RunConfig, hw: Any) -> str:
    """'Speed (predicted, H100 SXM): 12,345 tokens/s · 200 steps ~1h05m' for the run on hw's GPUs; '' where
    the speed model cannot say (CPU ranks, a GPU it does not know). Never raises: a courtesy."""
    if hw is None or cfg.parallel.device == "cpu":
        return ""
    try:
        from shardconsole.plan.speed.model import predict
        from shardconsole.settings.models import resolve
        p = predict(cfg, resolve(cfg.model.name), hw)
    except Exception:
        return ""
    if p is None:
        return ""
    return (f"Speed (predicted, {card_title(p.card)}): {p.tokens_per_s:,.0f} tokens/s · "
            f"{cfg.train.steps} steps ~{duration(p.seconds)}")


def duration(seconds: float) -> str:
    """3h05m, 12m30s, 45s (as `shardconsole plan` says it)."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
