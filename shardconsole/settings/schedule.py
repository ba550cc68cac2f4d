"""The learning-rate schedule as a function of the settings: what the ranks apply before each optimizer
step (backends/rank/common.py re-exports it) and what `resume` says the added steps get. No torch.

A resume that adds steps keeps the schedule the run had (train.schedule_steps = the steps it spanned):
past its end the lr stays at the value the schedule reached there, a constant tail. Re-stretching the
cosine over the new length instead sent the lr back up at the first resumed step (issue 36 item 5).
"""

from __future__ import annotations

import math

from shardconsole.settings import config as C


def schedule_end(cfg: C.RunConfig) -> int:
    return cfg.train.schedule_steps or cfg.train.steps


def lr_factor(cfg: C.RunConfig, step: int) -> float:
    """Multiplier of train.lr at optimizer step `step` (1-based): linear warm-up, then cosine or flat,
    held at its final value after schedule_end."""
    t = cfg.train
    step = min(step, schedule_end(cfg))
    if t.warmup_steps and step <= t.warmup_steps:
        return step / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    span = max(1, schedule_end(cfg) - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_text(cfg: C.RunConfig) -> str:
    """One line: the schedule over the run's steps and, past its end, the tail the added steps get."""
    t, end = cfg.train, schedule_end(cfg)
    warm = f"warm-up over steps 1-{t.warmup_steps}, then " if t.warmup_steps else ""
    shape = f"constant {t.lr:.2e}" if t.schedule == "constant" else \
        f"cosine from {t.lr:.2e} to {t.lr * t.min_lr_ratio:.2e} by step {end}"
    text = f"lr: {warm}{shape}"
    if t.steps > end:
        text += (f"; steps {end + 1}-{t.steps} keep {t.lr * lr_factor(cfg, end):.2e}, the lr the schedule "
                 f"ended on (a constant tail; --set train.schedule_steps={t.steps} stretches it instead)")
    return text
