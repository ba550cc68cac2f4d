"""Issue 35 in the planner and the tuner: the numerics a 24 GB user would change for speed, each held
unless named (`tune --vary KEY`), and the one line under the table that says what a change would give:
a low-bit optimizer where its fewer bytes let the model leave offload, no clip where that lets the FSDP2
offload's host step run under the backward. Planner only (an empty speed book: cold-start factors)."""

from __future__ import annotations

import re

from pathlib import Path

import pytest

from shardconsole import plan as PL
from shardconsole.cli import tune as tune_cli
from shardconsole.plan import search
from shardconsole.plan.speed.book import SpeedBook, cold_score
from shardconsole.settings import models
from shardconsole.settings import resolve as settings
from shardconsole.tune.engine import Tune
from shardconsole.tune.report import numerics_note

# 3090-7b-offload as it was before it dropped its clip (the article's 1.0): the user these tests are about
CLIPPED = ["train.clip_grad_norm=1.0"]
CARD = PL.Hardware(gpus=1, gpu_memory_bytes=24 * 2**30, host_memory_bytes=125 * 2**30, gpu_name="NVIDIA H200")


def _planned(preset: str, sets: list[str], vary: frozenset = frozenset()) -> Tune:
    base = settings.resolve(preset, sets).cfg
    tune = Tune(base, models.resolve(base.model.name), CARD, None, Path("."), SpeedBook([]), vary=set(vary))
    tune.options = search.options(base, tune.spec, CARD, tune.book, vary=set(vary))
    return tune


def test_no_clip_is_searched_only_when_named_and_only_where_it_lets_the_offload_overlap():
    held = _planned("3090-7b-offload", CLIPPED)
    assert {o.cfg.train.clip_grad_norm for o in held.options} == {1.0}
    named = _planned("3090-7b-offload", CLIPPED, frozenset({"train.clip_grad_norm"})).options
    unclipped = [o for o in named if o.cfg.train.clip_grad_norm == 0]
    assert unclipped and {o.cfg.train.clip_grad_norm for o in named} == {1.0, 0.0}
    # the clip goes only where the host step then runs under the backward: FSDP2 with CPU offload
    assert all(o.cfg.parallel.backend == "fsdp" and o.cfg.fsdp.cpu_offload for o in unclipped)
    clipped_twin = next(o for o in named if o.cfg.train.clip_grad_norm == 1.0
                        and o.name == unclipped[0].name)
    assert unclipped[0].prediction.value > clipped_twin.prediction.value
    assert search.numerics_changed(unclipped[0].cfg, held.base) == ["train.clip_grad_norm"]
    # CPU ranks have no offload: asking changes nothing
    cpu = _planned("tiny-cpu", [], frozenset({"train.clip_grad_norm"}))
    assert {o.cfg.train.clip_grad_norm for o in cpu.options} == {cpu.base.train.clip_grad_norm}


def test_the_overlap_counts_in_the_cold_start_only_when_it_can_run():
    base = settings.resolve("3090-7b-offload", CLIPPED).cfg
    free = PL.replace_cfg(base, ("train", "clip_grad_norm", 0.0))
    off = PL.replace_cfg(free, ("fsdp", "offload_overlap", False))
    assert cold_score(free) > cold_score(base) == pytest.approx(cold_score(off))


def test_a_3b_offload_user_is_told_of_adamw8bit_without_offload():
    """3090-offload at 3b on a 24 GB card: at the preset's numerics only offload fits; 8-bit states on
    bf16 weights fit without it (measured on the H200: 11.0k tokens/s against 2.6k offloaded)."""
    tune = _planned("3090-offload", ["model.name=3b"])
    assert all(o.cfg.fsdp.cpu_offload for o in tune.options if o.estimate.fits)
    note = numerics_note(tune)
    assert note.startswith("bf16 masters and adamw8bit optimizer would give ~"), note     # the speed model's tokens/s
    assert "no_shard" in note and "+offload" not in note
    assert "--vary precision.master_dtype --vary optim.name probes it" in note


def test_a_7b_offload_user_is_told_what_the_clip_costs():
    note = numerics_note(_planned("3090-7b-offload", CLIPPED))
    # compiled layers hide the host step under the backward (~1.9 s under a ~3.1 s GPU part on the H200),
    # where the clip makes it follow: the speed model's ratio lies between the two extremes
    m = re.search(r"tokens/s, (\d+\.\d)x the fastest", note)
    assert note.startswith("no gradient clip would give ~") and m and 1.1 < float(m.group(1)) < 1.7, note
    assert note.endswith("--vary train.clip_grad_norm probes it") and 'docs/OFFLOAD.md, "The host step under the backward"' in note
    # named, it is an option, so the note has nothing left to say of it
    assert "no gradient clip" not in numerics_note(_planned("3090-7b-offload", CLIPPED,
                                                            frozenset({"train.clip_grad_norm"})))


def test_the_vary_help_names_every_numerics_key(capsys):
    with pytest.raises(SystemExit):
        tune_cli._parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for key in search.NUMERICS:
        assert key in text, key


def test_plan_fit_at_low_bit_states_names_them_and_the_strategies_they_rule_out(capsys):
    """`plan --fit --set optim.name=adamw8bit --set precision.master_dtype=bf16`: 3b trains on one 24 GiB
    card without offload (1b at the defaults), the header names the states, and the strategies that
    settings refuse (offload, DeepSpeed) are one line each, not a largest model they could never run."""
    from shardconsole.cli import main as cli
    card = ["plan", "--fit", "--gpus", "1", "--gpu-memory", "24GiB", "--host-memory", "125GiB"]
    assert cli.main(card) == 0
    plain = capsys.readouterr().out
    assert cli.main([*card, "--set", "optim.name=adamw8bit", "--set", "precision.master_dtype=bf16"]) == 0
    low = capsys.readouterr().out
    row = lambda out, name: next(x.split() for x in out.splitlines() if x.split()[:1] == [name])  # noqa: E731
    assert row(plain, "no_shard")[1] == "1b" and row(low, "no_shard")[1] == "3b"
    assert "bf16 masters, adamw8bit states" in low.splitlines()[1] and "masters" not in plain.splitlines()[1]
    assert row(low, "full_shard+offload")[1] == "-" and row(plain, "full_shard+offload")[1] == "7b"
    refusals = [x for x in low.splitlines() if "refused with these settings" in x]
    assert len(refusals) == 2 and refusals[0].strip().startswith("full_shard+offload: ")
    assert "for runs without offload" in refusals[0] and "ZeRO-3+offload" in refusals[1]
    assert "refused" not in plain


def test_plan_says_when_the_clip_keeps_the_offloads_host_step_after_the_backward():
    from shardconsole.plan import estimator

    def notes(*sets):
        cfg = settings.resolve("3090-7b-offload", [*CLIPPED, *sets]).cfg
        return [n for n in estimator.estimate(cfg, models.resolve("7b"), CARD).notes if "host optimizer step" in n]
    [note] = notes()
    assert note.startswith("the host optimizer step runs after the backward: train.clip_grad_norm = 1 needs")
    assert "0 lets it run under the backward" in note
    assert notes("train.clip_grad_norm=0") == [] and notes("fsdp.offload_overlap=false") == []
