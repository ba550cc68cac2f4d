"""loop.ending, how both engines' train end (a real gloo group of one rank, a real stream): a failure is
reported once and before the group goes (a peer that sees it go must not be first to report), what the
engine held is released last-first, and after success the group is left to __main__'s barrier."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardconsole.backends.observe import failures
from shardconsole.backends.engine import loop
from shardconsole.backends.rank.common import Rank
from shardconsole.runlog.stream import MetricsWriter
from shardconsole.settings import config as C
from shardconsole.settings.models import resolve
from tests.conftest import messages, of_kind


def _rank(tmp_path) -> Rank:
    cfg = C.RunConfig()
    writer = MetricsWriter(tmp_path / "metrics.jsonl", "run", 0)
    return Rank(cfg, tmp_path, "run", 0, 0, 1, torch.device("cpu"), writer, resolve(cfg.model.name))


def test_a_failure_is_reported_once_before_the_group_goes_and_the_held_is_released(tmp_path):
    r = _rank(tmp_path)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    seen: list[tuple[str, bool, int]] = []

    def release(name: str):
        return lambda: seen.append((name, dist.is_initialized(), len(of_kind(messages(tmp_path), "failed"))))

    try:
        with pytest.raises(ValueError) as raised:
            with loop.ending(r) as held:
                held += [release("first"), release("second")]
                raise ValueError("injected")
        assert seen == [("second", True, 1), ("first", True, 1)]     # reported, then released, group still up
        assert not dist.is_initialized()
        failures.report_failure(r, raised.value, tmp_path, "run")   # __main__'s call after it: nothing more
        (failed,) = of_kind(messages(tmp_path), "failed")
        assert failed.cause == "crash" and failed.message == "injected"
        with loop.ending(r) as held:                                # success: released, the group left up
            dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg2'}", rank=0, world_size=1)
            held.append(release("after success"))
        assert seen[-1] == ("after success", True, 1) and dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
