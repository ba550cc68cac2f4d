"""The combination matrix (issue 44 items 3-4): every combination the settings accept runs to the end on
both engines, or is refused before launch in one line.

Points are drawn from the settings tables' own choices (tests/combinations.py), a third of them training
another objective than SFT (DPO, ORPO, SimPO, KTO, GRPO: train.objective's choices, on tests/data/objectives/),
with a seed that differs each run (printed in pytest's header; SHARDCONSOLE_MATRIX_SEED=N repeats one;
SHARDCONSOLE_MATRIX_RUNS and SHARDCONSOLE_MATRIX_REFUSALS size the sample). For each point:
- refused: the CLI exits 2 with one error line on stderr and no rank started (no rank log, no hello);
- accepted: a real 2-rank CPU run of 3-4 steps on a tiny Hugging Face folder made here ends with exit 0;
  its final checkpoint is complete (runlog/checkpoint_files) and of the kind train.save_final asks for;
  its export folder loads in transformers with every weight; a resumed point continues from its newest
  resumable checkpoint (or is refused before launch).
Every failure names the point, the seed and the command that repeats it.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.combinations import SEED, SEED_ENV, Combo, predicted_refusal, sample
from tests.conftest import messages, of_kind, shardconsole

RUNS = int(os.environ.get("SHARDCONSOLE_MATRIX_RUNS", "16"))
REFUSALS = int(os.environ.get("SHARDCONSOLE_MATRIX_REFUSALS", "16"))
RUN_TIMEOUT = 600        # a cold machine builds DeepSpeed's CPUAdam inside its first offloaded run
# What every point shares: the paths are added per session (the model folder is made here).
BASE = ["data.seq_len=16", "train.micro_batch=1", "train.log_every=1", "train.warmup_steps=0"]
ACCEPTED, REFUSED = sample(SEED, RUNS, REFUSALS, BASE)


def _repeat(combo: Combo, m: SimpleNamespace, test: str) -> str:
    return (f"\ncombination: {combo.label()}\nseed {SEED}: {SEED_ENV}={SEED} pytest tests/test_combinations.py "
            f"-k '{test}'\nby hand: {combo.command([*BASE, *m.paths])}")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> SimpleNamespace:
    """One model folder, corpus and token cache for every point (the ranks tokenize the corpus once)."""
    from tests.hf_fixtures import CORPUS, make_hf_model
    root = tmp_path_factory.mktemp("matrix")
    model = make_hf_model(root / "model")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{i}: {t}"}) + "\n" for i, t in enumerate(CORPUS[:60])))
    env = {"SHARDCONSOLE_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "token-cache"),
           "SHARDCONSOLE_RUNS_ROOT": str(root / "runs"), "DS_ACCELERATOR": "cpu"}
    return SimpleNamespace(root=root, model=model, env=env,
                           paths=[f"model.name={model}", "data.source=auto", f"data.path={corpus}"])


def _argv(combo: Combo, m: SimpleNamespace, run: Path) -> list[str]:
    sets = combo.sets(str(run) + "-export", str(run) + "-nvme")
    return ["--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
            *[a for s in [*BASE, *m.paths, *sets] for a in ("--set", s)]]


def assert_refused_before_launch(res, run: Path, why: str) -> str:
    """Exit 2, one error line (notes before it are lines of their own, never a traceback), no rank."""
    assert res.returncode == 2, f"exit {res.returncode}, not 2{why}\n{res.stderr[-3000:]}"
    lines = res.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("shardconsole: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], f"not one error line{why}\n{res.stderr[-3000:]}"
    assert all(ln.startswith("shardconsole: ") for ln in lines), f"stray stderr{why}\n{res.stderr[-3000:]}"
    assert not list(run.glob("logs/rank*.log")), f"a rank started{why}"
    stream = run / "metrics.jsonl"
    assert not stream.exists() or not of_kind(messages(run), "hello"), f"a rank said hello{why}"
    return errors[0]


def test_every_refusal_resolve_makes_is_one_line_naming_its_key():
    """A large draw, in process (no launch): each refusal is a ConfigError of one line that names the
    table and key at fault; qlora on this CPU machine is always refused, blamed on train.method."""
    from shardconsole.settings import config as C
    from shardconsole.settings import resolve as settings
    rng, counts = random.Random(SEED), {"accepted": 0, "refused": 0}
    for _ in range(300):
        combo = Combo.draw(rng)
        try:
            settings.resolve("tiny-cpu", settings.from_cli([*BASE, *combo.sets()]))
        except C.ConfigError as e:
            counts["refused"] += 1
            assert "\n" not in str(e) and e.path, f"{e!r}\ncombination {combo.label()} (seed {SEED})"
            continue
        counts["accepted"] += 1
        assert combo.get("train.method") != "qlora", f"qlora accepted on CPU: {combo.label()} (seed {SEED})"
    assert counts["accepted"] and counts["refused"], counts
    for backend in ("fsdp", "deepspeed"):      # qlora alone: CUDA only, blamed on train.method
        with pytest.raises(C.ConfigError) as e:
            settings.resolve("tiny-cpu", settings.from_cli([*BASE, "train.method=qlora", "precision.dtype=bf16",
                                                            f"parallel.backend={backend}", "deepspeed.stage=2"]))
        assert e.value.path == "train.method" and "CUDA" in str(e.value), str(e.value)


@pytest.mark.parametrize("index", range(len(REFUSED)), ids=[f"refused{i}" for i in range(len(REFUSED))])
def test_a_refused_combination_stops_before_any_rank(index, matrix, tmp_path):
    combo, predicted = REFUSED[index]
    run = tmp_path / "run"
    res = shardconsole(*_argv(combo, matrix, run), timeout=120, env=matrix.env)
    line = assert_refused_before_launch(res, run, _repeat(combo, matrix, f"refused{index}"))
    # (a qlora point may meet another rule first: that qlora alone is refused here is
    # test_every_refusal_resolve_makes_is_one_line_naming_its_key's, and test_lora's)
    assert line == f"shardconsole: error: {predicted}", _repeat(combo, matrix, f"refused{index}")


def assert_saves(combo: Combo, run: Path, steps: int, why: str, start: int = 0) -> None:
    """The checkpoints the settings promise, complete, each of the kind it should be: a periodic one and
    a final "full" one resume; a final "model" one may be the weights alone (an engine that keeps its
    masters in the optimizer's partitions writes a checkpoint for it)."""
    from shardconsole.runlog.checkpoint_files import why_incomplete
    every, final = combo.get("train.checkpoint_every"), combo.get("train.save_final")
    periodic_last = bool(every) and steps % every == 0
    for step in range(start + 1, steps):
        if every and step % every == 0:
            folder = _step_folder(run, step)
            assert why_incomplete(folder, combo.backend) is None, f"step {step}: {why_incomplete(folder, combo.backend)}{why}"
            assert _what(folder) == "checkpoint", f"step {step}: {_what(folder)}{why}"
    folder = _step_folder(run, steps)
    if final == "none" and not periodic_last:
        assert not folder.exists(), f"a final save with save_final=none{why}"
        return
    assert why_incomplete(folder, combo.backend) is None, f"final: {why_incomplete(folder, combo.backend)}{why}"
    kinds = {"checkpoint", "model"} if final == "model" and not periodic_last else {"checkpoint"}
    assert _what(folder) in kinds, f"final save is a {_what(folder)!r}, not {kinds}{why}"


def _step_folder(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _what(folder: Path) -> str:
    from shardconsole.runlog.checkpoint_files import MANIFEST
    return str(json.loads((folder / MANIFEST).read_text()).get("what", "checkpoint"))


def assert_export_loads(folder: Path, why: str) -> None:
    """transformers loads the folder with every weight it expects and none left over; an adapters
    folder goes onto its base through peft."""
    import torch
    from transformers import AutoModelForCausalLM
    assert folder.is_dir(), f"no export folder {folder}{why}"
    if (folder / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM
        model = AutoPeftModelForCausalLM.from_pretrained(folder)
    else:
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], f"{info}{why}"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all(), f"non-finite logits from the export{why}"


def _resumable_steps(run: Path, steps: int) -> list[int]:
    """Steps holding a complete checkpoint the ranks resume from (a weights-alone save is not one)."""
    return [s for s in range(1, steps + 1) if _step_folder(run, s).is_dir() and _what(_step_folder(run, s)) != "model"]


def _resume(combo: Combo, m: SimpleNamespace, run: Path, why: str) -> None:
    """Two more steps in the same folder: they continue from the newest resumable checkpoint, or the
    resume is refused before launch in one line."""
    steps = combo.get("train.steps")
    before = len(of_kind(messages(run), "hello"))
    resumable = _resumable_steps(run, steps)
    # the export never overwrites the first session's folder: a resume names a new one (refused otherwise:
    # test_a_resume_onto_the_earlier_export_folder_is_refused_before_launch)
    again = ["--set", f"train.export_dir={run}-export2"] if combo.export else []
    res = shardconsole("resume", str(run), "--set", f"train.steps={steps + 2}", *again, timeout=RUN_TIMEOUT,
                       env=m.env)
    if res.returncode == 2 or not resumable:
        # nothing to continue from (no save, or weights alone): refused, never a restart from step 0
        assert_refused_before_launch_of_resume(res, run, before, why)
        return
    assert res.returncode == 0, f"resume: exit {res.returncode}{why}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    step_lines = of_kind(messages(run), "step")
    second = [s.step for s in step_lines if s.run != step_lines[0].run]
    start = resumable[-1] if resumable else 0
    assert second and second[0] == start + 1 and second[-1] == steps + 2, f"resumed steps {second}{why}"
    assert_saves(combo, run, steps + 2, why, start=start)
    if combo.export:
        assert_export_loads(Path(f"{run}-export2"), why)


def assert_refused_before_launch_of_resume(res, run: Path, hellos_before: int, why: str) -> None:
    assert res.returncode == 2, f"resume: exit {res.returncode}, not a refusal{why}\n{res.stderr[-3000:]}"
    lines = res.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("shardconsole: error: ") and "Traceback" not in res.stderr, \
        f"resume refused without one line{why}\n{res.stderr[-3000:]}"
    assert len(of_kind(messages(run), "hello")) == hellos_before, f"a rank started before the refusal{why}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(ACCEPTED)), ids=[f"run{i}" for i in range(len(ACCEPTED))])
def test_an_accepted_combination_runs_to_the_end(index, matrix, tmp_path):
    combo = ACCEPTED[index]
    run = tmp_path / "run"
    why = _repeat(combo, matrix, f"run{index}")
    assert predicted_refusal(combo, BASE) is None
    res = shardconsole(*_argv(combo, matrix, run), timeout=RUN_TIMEOUT, env=matrix.env)
    if res.returncode == 2 and not list(run.glob("logs/rank*.log")):
        # refused by a check of this machine (preflight) that resolve cannot make: still before launch
        assert_refused_before_launch(res, run, why)
        return
    assert res.returncode == 0, f"exit {res.returncode}{why}\n{res.stdout[-2500:]}\n{res.stderr[-3000:]}"
    steps = combo.get("train.steps")
    assert [s.step for s in of_kind(messages(run), "step")][-1] == steps, why
    assert_saves(combo, run, steps, why)
    if combo.export:
        assert_export_loads(Path(str(run) + "-export"), why)
    if combo.resume:
        _resume(combo, matrix, run, why)


# ---------------------------------------------------------------------------------------------------
# The refusals the matrix found, each on its own (a sampled run meets them only now and then).

def test_nvme_offload_is_refused_before_launch_where_libaio_is_missing(matrix, tmp_path):
    """DeepSpeed's async I/O op links libaio: without it the ranks refused "nvme" only after they started.
    Real either way: on a machine with libaio the preflight lets it through."""
    import ctypes.util

    from shardconsole.session import preflight
    from shardconsole.settings import resolve as settings
    sets = ["parallel.backend=deepspeed", "deepspeed.stage=3", "deepspeed.offload_optimizer=nvme",
            f"deepspeed.nvme_path={tmp_path / 'nvme'}"]
    if ctypes.util.find_library("aio") is not None:
        preflight.check_nvme_offload(settings.resolve("tiny-cpu", settings.from_cli(sets)))
        return
    run = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *[a for s in [*BASE, *matrix.paths, *sets] for a in ("--set", s)], timeout=120, env=matrix.env)
    line = assert_refused_before_launch(res, run, "")
    assert "deepspeed.offload_optimizer" in line and "libaio" in line and '"cpu"' in line, line


@pytest.mark.slow
def test_resume_of_a_weights_only_save_is_refused_not_restarted(matrix, tmp_path):
    """train.save_final = "model" keeps the weights alone; the ranks cannot resume from it, and `resume`
    launched them anyway: they started again from step 0 under the name of a resume."""
    run = tmp_path / "run"
    sets = [*BASE, *matrix.paths, "train.steps=2", "train.save_final=model"]
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *[a for s in sets for a in ("--set", s)], timeout=RUN_TIMEOUT, env=matrix.env)
    assert res.returncode == 0, res.stderr[-3000:]
    hellos = len(of_kind(messages(run), "hello"))
    res = shardconsole("resume", str(run), "--set", "train.steps=4", timeout=RUN_TIMEOUT, env=matrix.env)
    assert_refused_before_launch_of_resume(res, run, hellos, "")
    assert "weights alone" in res.stderr and "export-model" in res.stderr, res.stderr


@pytest.mark.slow
def test_a_resume_onto_the_earlier_export_folder_is_refused_before_launch(matrix, tmp_path):
    """The resumed run writes train.export_dir again at its end, and the export never overwrites: the run
    trained, saved, then failed on the first session's folder ("Directory not empty")."""
    run, export = tmp_path / "run", tmp_path / "export"
    sets = [*BASE, *matrix.paths, "train.steps=2", f"train.export_dir={export}"]
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *[a for s in sets for a in ("--set", s)], timeout=RUN_TIMEOUT, env=matrix.env)
    assert res.returncode == 0, res.stderr[-3000:]
    hellos = len(of_kind(messages(run), "hello"))
    res = shardconsole("resume", str(run), "--set", "train.steps=3", timeout=RUN_TIMEOUT, env=matrix.env)
    assert_refused_before_launch_of_resume(res, run, hellos, "")
    assert "[train] export_dir" in res.stderr and "train.export_dir=NEW_FOLDER" in res.stderr, res.stderr


@pytest.mark.slow
def test_one_low_bit_optimizer_after_the_other_on_a_shared_compile_cache(matrix, tmp_path):
    """torchao's 8-bit and 4-bit steps of FSDP2's DTensor states shared Inductor's on-disk cache entries:
    the second run (either order) crashed at step 1, "wrong number of dimensions1 for op: input"."""
    env = {**matrix.env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for name in ("adamw8bit", "adamw4bit"):
        sets = [*BASE, *matrix.paths, "train.steps=2", "train.save_final=none", f"optim.name={name}"]
        res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / name),
                           *[a for s in sets for a in ("--set", s)], timeout=RUN_TIMEOUT, env=env)
        assert res.returncode == 0, f"{name}: {res.stdout[-2000:]}\n{res.stderr[-2000:]}"
