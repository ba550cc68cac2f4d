"""The type checker over the ranks' code and the front end (pyproject's [tool.mypy]): both engines implement one typed
contract (backends/engine/contract.py), so a save called with the wrong arguments, or an engine that
drifts from the contract, is red here before any run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_the_ranks_code_type_checks():
    res = _mypy()
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def test_a_save_with_the_wrong_arguments_is_a_type_error(tmp_path):
    """What crashed DeepSpeed runs of train.save_final = "model" at their last step: a save called with a
    string kind, or without one, on either engine."""
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        from shardconsole.backends.checkpoint.checkpoints import SaveKind
        from shardconsole.backends.engine.contract import Engine
        from shardconsole.backends.engine.ds_engine import DeepSpeedEngine
        from shardconsole.backends.engine.fsdp_engine import FsdpEngine

        def calls(e: Engine, d: DeepSpeedEngine, f: FsdpEngine) -> None:
            e.save(3, SaveKind.MODEL)       # right
            e.save(3)                       # wrong: no kind
            d.save(3, "model")              # wrong: a string
            f.save(3, SaveKind.MODEL, 1)    # wrong: one argument too many
    """))
    res = _mypy("--config-file", str(REPO / "pyproject.toml"), str(probe))
    errors = [line for line in res.stdout.splitlines() if "error:" in line]
    assert [int(line.split(":")[1]) for line in errors] == [9, 10, 11], res.stdout


def test_the_front_ends_seams_are_type_errors_when_broken(tmp_path):
    """Issue 50: the run session's job is a RunJob (Job and ExternalJob), the planner a Planner (the module
    shardconsole.plan), the run screen's resume a callable of a run folder: a stand-in that drifts is red."""
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        import os
        from pathlib import Path
        from shardconsole import plan
        from shardconsole.console.screens.run import RunScreen
        from shardconsole.console.services import MachineProbes
        from shardconsole.launch.job import ExternalJob
        from shardconsole.session.planner import Planner
        from shardconsole.session.run import RunSession

        class Half:
            def poll(self) -> int | None: return None
            def alive(self) -> bool: return True

        def calls(d: Path, s: RunSession) -> None:
            p: Planner = plan                                           # right
            RunSession(ExternalJob(d), d)                               # right
            RunScreen(s, MachineProbes(), resume=RunSession.attach)     # right
            RunSession(Half(), d)                                       # wrong: not a RunJob
            q: Planner = os                                             # wrong: not a planner
            RunScreen(s, MachineProbes(), resume=lambda: s)             # wrong: resume takes the folder
    """))
    res = _mypy("--config-file", str(REPO / "pyproject.toml"), str(probe))
    errors = [line for line in res.stdout.splitlines() if "error:" in line]
    assert sorted({int(line.split(":")[1]) for line in errors}) == [19, 20, 21], res.stdout
