"""The memory planner as the front ends use it: a typed seam (the module shardconsole.plan implements it),
so the console and the pre-launch checks are given a planner (tests: a fixed one, or none) instead of a
module passed around and probed with getattr. No torch: the planner imports none."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shardconsole.settings import config as C

if TYPE_CHECKING:
    from shardconsole.plan.estimator import Estimate
    from shardconsole.plan.machine import Hardware as Machine
    from shardconsole.plan.saves import Saves
    from shardconsole.plan.shapes import Shapes
    from shardconsole.settings.models import ModelSpec


class Planner(Protocol):
    """What the front ends call of shardconsole.plan (see its docstring for what each one models)."""

    @property
    def Hardware(self) -> "type[Machine]": ...      # the class, built from the console's probes

    def estimate(self, cfg: C.RunConfig, spec: "ModelSpec", hw: "Machine", *, start_step: int = 0,
                 existing: list[int] = ...) -> "Estimate": ...

    def detect_hardware(self) -> "Machine": ...

    def replace_cfg(self, cfg: C.RunConfig, *changes: tuple[str, str, Any]) -> C.RunConfig: ...

    def saves(self, cfg: C.RunConfig, s: "Shapes", spec_path: str | Path | None = None, *, start_step: int = 0,
              existing: list[int] = ...) -> "Saves": ...

    def schedule(self, cfg: C.RunConfig, start_step: int = 0,
                 save_final: str | None = None) -> list[tuple[int, str]]: ...

    def disk_peak(self, sizes: list[int], keep: int, existing: list[int] = ...) -> tuple[int, int, int]: ...

    def save_final_of(self, cfg: C.RunConfig) -> str: ...


def load_planner() -> Planner | None:
    """shardconsole.plan, or None where it cannot be imported (the console then says so)."""
    try:
        from shardconsole import plan
    except ImportError:
        return None
    return plan
