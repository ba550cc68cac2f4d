"""FSDP2's checkpoint format is one module (backends/engine/fsdp_checkpoint.py), as DeepSpeed's is
ds_checkpoint.py: no other engine file writes or reads DCP, builds the saved state or reads a rank's state
back, so a change of the format is made and reviewed in one place."""

from __future__ import annotations

import re
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "shardconsole" / "backends" / "engine"
FORMAT = re.compile(r"dcp\.(save|load)\(|StreamingWriter\(|get_optimizer_state_dict\(|set_optimizer_state_dict\("
                    r"|read_rank_state\(|write_rank_state\(|newest_complete\(|class SafeReader|def safe_load_planner")


def test_only_fsdp_checkpoint_holds_fsdp2s_format():
    found = sorted({p.name for p in ENGINE.glob("*.py") if FORMAT.search(p.read_text())})
    assert found == ["ds_checkpoint.py", "fsdp_checkpoint.py"], found


def test_the_engine_saves_and_loads_through_it():
    from shardconsole.backends.engine import fsdp_checkpoint
    from shardconsole.backends.engine.fsdp_engine import FsdpEngine
    names = set(FsdpEngine.save.__code__.co_names) | set(FsdpEngine.load.__code__.co_names)
    assert {"fsdp_checkpoint", "save", "load"} <= names
    assert callable(fsdp_checkpoint.save) and callable(fsdp_checkpoint.load)
