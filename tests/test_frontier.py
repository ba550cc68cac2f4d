"""Issue 34 and 36.12: the planner's verdict against the whole card and its exit code, the cap as a
device, and presets written by export / ctrl+s that load without warning about their own defaults."""

from __future__ import annotations

import tomllib

import pytest

from conftest import shardconsole
from shardconsole.cli import main as cli
from shardconsole.settings import config as C
from shardconsole.settings import preset_store
from shardconsole.settings import resolve as settings

GiB = 2**30


@pytest.mark.parametrize("preset", [p.name for p in preset_store.list_presets()])
def test_an_exported_preset_loads_with_no_warning_and_as_the_same_settings(preset, tmp_path):
    out = tmp_path / f"{preset}.toml"
    r = shardconsole("export", "--preset", preset, "--format", "toml", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "has no effect" not in r.stderr
    loaded = settings.resolve(str(out))
    assert loaded.notes == [], loaded.notes
    assert loaded.cfg.to_dict() == settings.resolve(preset).cfg.to_dict()
    # only what differs from the defaults is written: the default rounding is not named
    assert "master_rounding" not in tomllib.loads(out.read_text()).get("precision", {})


def test_a_preset_saved_from_the_console_loads_with_no_warning(_user_presets):
    cfg = settings.resolve("3090-offload").cfg
    path = preset_store.save_user_preset(cfg, "mine")             # what ctrl+s calls
    loaded = settings.resolve("mine")
    assert loaded.notes == [] and loaded.cfg.to_dict() == cfg.to_dict()
    with pytest.raises(FileExistsError):
        preset_store.save_user_preset(cfg, "mine")
    assert path.read_text().startswith("description = ")


def test_a_default_never_warns_but_a_value_that_does_nothing_does():
    # a file of an earlier version spells out every key, the default rounding among them
    doc = tomllib.loads(C.dumps(settings.resolve("3090-fsdp").cfg))
    assert doc["precision"]["master_rounding"] == "nearest"
    assert settings.resolve_doc(doc, "old", None).notes == []
    doc["precision"]["master_rounding"] = "kahan"
    assert any("has no effect" in n for n in settings.resolve_doc(doc, "old", None).notes)


def test_plan_exits_3_when_it_does_not_fit(capsys):
    base = ["plan", "--preset", "3090-fsdp", "--gpu-memory", "24GiB", "--host-memory", "64GiB"]
    assert cli.main(base) == 0
    assert cli.main([*base, "--set", "memory.activation_checkpointing=false", "--set", "train.micro_batch=8"]) == 3
    out = capsys.readouterr().out
    assert "verdict: does not fit" in out                           # the plan is printed all the same
    assert cli.main([*base, "--json", "--set", "train.micro_batch=8",
                     "--set", "memory.activation_checkpointing=false"]) == 3
