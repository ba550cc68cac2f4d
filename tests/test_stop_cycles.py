"""Stops at random moments (start-up, loading, training, checkpoint saves) never leave a process.
benchmarks/stop_cycles.py runs the same with 50 cycles per backend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from stop_cycles import run_cycles  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend, cycles", [("fsdp", 5), ("deepspeed", 3)])
def test_random_stops_leave_nothing(backend, cycles):
    results = run_cycles(backend, cycles, max_wait=14.0, grace=5.0, seed=7)
    assert all(not r["left"] for r in results), results
    assert all(r["stop_s"] < 12 for r in results), results
