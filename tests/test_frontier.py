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
    if loaded.cfg.precision.master_rounding == "nearest":
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


# ---------------------------------------------------------------------------------------------------
# A cap is the whole device (issue 34 items 2 and 3)

def _plan_json(capsys, *argv: str, preset: str = "3090-fsdp") -> dict:
    import json
    assert cli.main(["plan", "--preset", preset, "--json", "--host-memory", "125GiB", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_24gib_cap_on_a_big_card_plans_as_a_24gb_card(capsys):
    from shardconsole import plan as PL
    from shardconsole.machine.hardware import allocator_limit_bytes, usable_bytes
    from shardconsole.settings.models import resolve
    card = _plan_json(capsys, "--gpus", "1", "--gpu-memory", "24GiB")
    capped = _plan_json(capsys, "--gpus", "1", "--gpu-memory", "143771MiB", "--set", "memory.gpu_memory_limit=24GiB")
    for key in ("gpu_budget_bytes", "gpu_device_bytes", "gpu_peak_bytes", "gpu_driver_reserved_bytes", "fits"):
        assert card[key] == capped[key], key
    assert card["gpu_device_bytes"] == 24 * GiB
    # a real RTX 3090, as NVML names and totals it: the same budget
    cfg = settings.resolve("3090-fsdp").cfg
    rtx = PL.estimate(cfg, resolve(cfg.model.name), PL.Hardware(1, 24576 * 2**20, 125 * GiB, "NVIDIA GeForce RTX 3090"))
    assert rtx.gpu_budget_bytes == card["gpu_budget_bytes"]
    # what a 24 GB card gives to processes (23.5-23.7 GiB), and what the ranks let the allocator hold
    # under the cap: the planner's budget, so that allocator + context + NCCL fit the card
    assert 23.5 * GiB <= usable_bytes(24 * GiB) <= 23.7 * GiB
    assert allocator_limit_bytes(24 * GiB, "fsdp") == card["gpu_budget_bytes"]
    assert card["gpu_budget_bytes"] + PL.CUDA_CONTEXT_BYTES["fsdp"] + card["gpu_driver_reserved_bytes"] == 24 * GiB


def test_the_verdict_is_the_nvml_peak_against_the_card(capsys):
    rc = cli.main(["plan", "--preset", "3090-7b-offload", "--set", "model.name=13b", "--set", "train.micro_batch=8",
                   "--set", "precision.master_rounding=stochastic", "--gpu-memory", "24GiB", "--host-memory", "125GiB"])
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("verdict: "))
    doc = _plan_json(capsys, "--set", "model.name=13b", "--set", "precision.master_rounding=stochastic",
                     "--set", "train.micro_batch=8", "--gpu-memory", "24GiB", preset="3090-7b-offload")
    assert rc == 0
    # "fits: peak 23.4 GiB of 24.0 GiB (98%) as NVML shows it (the allocator needs ...)"
    assert verdict.startswith("verdict: fits") and " of 24.0 GiB (" in verdict and "as NVML shows it" in verdict
    pct = int(verdict.split(" of 24.0 GiB (", 1)[1].split("%", 1)[0])
    assert pct >= 90                                 # the run is near the card's end: the verdict says so
    assert "the allocator needs" in verdict and "left to it after context and driver" in verdict
    assert doc["gpu_device_bytes"] == 24 * GiB


def test_a_probe_is_under_the_cap_only_when_its_nvml_peak_is(_runs_root):
    """A probe on the H200 under a 24 GiB cap: its NVML peak less the H200's idle part plus a 24 GB card's
    must be under 24 GiB. 24.3 GiB NVML (issue 34's probe, counted a winner then) is over."""
    from shardconsole import plan as PL
    from shardconsole.tune.engine import Row
    from shardconsole.tune.probe import ProbeResult
    from shardconsole.tune.setup import make_tune
    h200 = PL.Hardware(1, 143771 * 2**20, 125 * GiB, "NVIDIA H200")
    tune = make_tune(settings.resolve("3090-offload"), budget_s=60, max_probes=2, probe_steps=3,
                     gpu_memory="24GiB", hardware=h200)
    tune.plan()
    option = tune.options[0]
    idle = 615 * 2**20
    over = Row(option, ProbeResult("ok", tokens_per_s=1000.0, gpu_peak_bytes=int(24.3 * GiB), gpu_idle_bytes=idle))
    under = Row(option, ProbeResult("ok", tokens_per_s=900.0, gpu_peak_bytes=int(23.5 * GiB), gpu_idle_bytes=idle))
    # 24.1 GiB on the H200 is 23.5 GiB of processes: 23.9 GiB on a 24 GB card, whose driver keeps less
    near = Row(option, ProbeResult("ok", tokens_per_s=950.0, gpu_peak_bytes=int(24.1 * GiB), gpu_idle_bytes=idle))
    for row in (over, under, near):
        tune._judge(row)
    assert over.result.status == "over cap" and "24.0 GiB card" in over.result.message
    assert under.result.ok and near.result.ok
    assert tune.card_peak_bytes(near.result) < 24 * GiB < tune.card_peak_bytes(over.result)
    tune.rows = [over, under]
    assert tune.winner() is under


def test_a_micro_batch_nobody_chose_is_lowered_where_it_would_fill_the_gpu():
    """3090-7b-offload's micro-batch 12 is 7b's (20.0 GiB NVML on the H200 under its 24 GiB cap); at 13b
    the same preset runs at 9 with its compiled layers, the shape measured to fit there (23.8 GiB NVML,
    21.7 reserved of the allocator's 22.3), and at 8 eager (23.3 NVML, 21.2 reserved), with one line
    that says so. A micro-batch the user set is kept, and CPU ranks are not planned for a GPU."""
    from shardconsole import plan as PL
    from shardconsole.session import preflight
    h200 = PL.Hardware(1, 141 * GiB, 125 * GiB, "NVIDIA H200")
    thirteen = settings.resolve("3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic"])
    fitted, line = preflight.fit_micro_batch(thirteen, 1, hardware=h200)
    assert thirteen.cfg.train.micro_batch == 12 and fitted.cfg.train.micro_batch == 9
    assert line.startswith("train.micro_batch: 3090-7b-offload's 12 at 13b needs all of the 22.3 GiB"), line
    assert "running at 9" in line and line.endswith("(--set train.micro_batch=12 keeps 12)")
    eager = settings.resolve("3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic",
                                                 "train.compile=false"])
    assert preflight.fit_micro_batch(eager, 1, hardware=h200)[0].cfg.train.micro_batch == 8
    assert fitted.origin("train", "micro_batch") == "fitted to this GPU"
    assert fitted.cfg.model.name == "13b" and fitted.cfg.precision.master_rounding == "stochastic"
    seven = settings.resolve("3090-7b-offload", ["precision.master_dtype=fp32"])
    assert preflight.fit_micro_batch(seven, 1, hardware=h200) == (seven, None)
    # a preset on its own model keeps the micro-batch measured with it, where the caching peak is at the budget
    from shardconsole.settings.models import resolve
    own = settings.resolve("3090-8b-64gb")
    assert preflight._gpu_full(PL.estimate(own.cfg, resolve("llama3-8b"), h200))
    assert preflight.fit_micro_batch(own, 1, hardware=h200) == (own, None)
    chosen = settings.resolve("3090-7b-offload", ["model.name=13b", "train.micro_batch=12"])
    assert preflight.fit_micro_batch(chosen, 1, hardware=h200) == (chosen, None)
    assert preflight.fit_micro_batch(thirteen, 0, hardware=h200) == (thirteen, None)
    cpu = settings.resolve("3090-7b-offload", ["model.name=13b", "parallel.device=cpu", "train.compile=false"])
    assert preflight.fit_micro_batch(cpu, 1, hardware=h200) == (cpu, None)
