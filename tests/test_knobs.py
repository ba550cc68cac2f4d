"""The environment a rank reads, in one typed object (backends/rank/knobs.py), and its documentation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardconsole.backends.rank.knobs import KnobError, Knobs

REPO = Path(__file__).resolve().parent.parent


def test_the_defaults_and_a_full_environment():
    assert Knobs.from_env({}) == Knobs()
    k = Knobs.from_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1",
                        "SHARDCONSOLE_STREAM": "off", "SHARDCONSOLE_OVERLAP_THREADS": "4, 8",
                        "SHARDCONSOLE_OVERLAP_NICE": "0", "SHARDCONSOLE_KILL_WAIT_S": "12.5",
                        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"})
    assert (k.rank, k.local_rank, k.world, k.node) == (3, 1, 4, 1)
    assert not k.stream and k.overlap_threads == (4, 8) and k.overlap_nice == 0
    assert k.kill_wait_s == 12.5 and k.launcher_grace_s == 45.0


@pytest.mark.parametrize("name, value", [("SHARDCONSOLE_OVERLAP_NICE", "low"), ("SHARDCONSOLE_KILL_WAIT_S", "soon"),
                                         ("SHARDCONSOLE_OVERLAP_THREADS", "4,x"), ("WORLD_SIZE", "two")])
def test_a_bad_value_is_one_line_naming_the_variable(name, value):
    with pytest.raises(KnobError) as e:
        Knobs.from_env({name: value})
    assert str(e.value).startswith(f"environment variable {name}={value!r}") and "\n" not in str(e.value)


def test_every_variable_a_rank_reads_is_documented():
    source = (REPO / "shardconsole" / "backends" / "rank" / "knobs.py").read_text()
    read = set(re.findall(r'e(?:\.get)?\(?[^"\n]*"([A-Z][A-Z0-9_]+)"', source.split("def from_env", 1)[1]))
    read |= {"SHARDCONSOLE_P2P_NOTE"}         # read through doctor_verdict.P2P_NOTE_ENV
    doc = (REPO / "docs" / "ENVIRONMENT.md").read_text()
    assert len(read) >= 15
    assert not [v for v in read if f"`{v}" not in doc and f" {v}" not in doc], sorted(read)
    # and no rank module reads a knob behind the object's back; the token cache's folder is the front ends'
    # too (the data preview opens the same cache), documented under "Where files go"
    backends = REPO / "shardconsole" / "backends"
    stray = [f"{p.relative_to(REPO)}: {m}" for p in backends.rglob("*.py") if p.name != "knobs.py"
             for m in re.findall(r'environ(?:\.get)?\(\s*"(SHARDCONSOLE_[A-Z_]+)"', p.read_text())
             if m != "SHARDCONSOLE_CACHE_DIR"]
    assert stray == [], stray
