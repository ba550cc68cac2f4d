"""Stops at each moment of a run (torchrun just spawned, ranks starting, loading, training, right after a
checkpoint save) never leave a process. Each moment is reached by what the stream and the process table
show (benchmarks/stop_cycles.MOMENTS), not after a fixed wait: the same moments on any machine's speed.
benchmarks/stop_cycles.py stops at random moments, 50 cycles per backend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from stop_cycles import run_moments  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend, moments", [
    ("fsdp", ["launch", "ranks starting", "loading", "training", "checkpoint"]),
    ("deepspeed", ["launch", "loading", "training"])])
def test_stops_at_every_moment_leave_nothing(backend, moments):
    results = run_moments(backend, moments, grace=5.0)
    assert all(not r["left"] for r in results), results
    # the moments past start-up were reached: those stops came after the ranks said hello
    assert all(r["phase"] != "not started" for r in results if r["wait"] in ("loading", "training", "checkpoint")), \
        results
    assert all(r["stop_s"] < 12 for r in results), results
