"""Issue 30's save path, on real ranks (torchrun, gloo, CPU): a save adds at most one tensor to the host
peak, resume after it is exact, a full disk is named and loses nothing, export_dir gives a folder
transformers loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import messages, of_kind, shardconsole

# A Llama of ~17M parameters (config.json only: random init), big enough that a copy of a rank's state
# (~100 MB in fp32 with Adam) stands far above the noise of a host peak, small enough for 2 CPU ranks.
# glibc serves allocations below its (adaptive, up to 32 MiB) mmap threshold from a heap it keeps
# resident after training's frees, which would hide a copy of the state from the resident-set peak;
# with every allocation over 128 KiB mapped and unmapped, the peak counts what a save holds.
RESIDENT = {"MALLOC_MMAP_THRESHOLD_": "131072"}
SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
             intermediate_size=1024, vocab_size=8192, max_position_embeddings=256)


@pytest.fixture(scope="module")
def model17m(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path_factory.mktemp("model17m")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False)).save_pretrained(folder)
    return folder


def _peaks(run_dir: Path) -> dict[tuple[int, int], dict[str, int]]:
    """{(rank, step): {training_peak, start, save_peak, total, ...}} from each rank's save_host_peak event."""
    out = {}
    for m in of_kind(messages(run_dir), "event"):
        if m.name == "save_host_peak":
            kv = dict(re.findall(r"(\w+)=(\S+)", m.detail))
            out[(m.rank, int(kv["step"]))] = {k: (v if k == "what" else float(v)) for k, v in kv.items()}
    return out


@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_an_offloaded_arena_save_adds_no_copy_of_the_state_and_resumes_exactly(tmp_path, model17m, master):
    """FSDP2 with fsdp.cpu_offload and the host arena: every shard is a view into one region, which DCP's
    own writer cloned and held to the end of the file (the rank's whole state). The save's rise of the
    host peak stays under a quarter of the rank's state (the largest tensor here is ~6 MB), and the run
    resumed from the first checkpoint repeats the uninterrupted run's steps exactly."""
    ckpt = tmp_path / "ckpt"
    prec = (["--set", "precision.dtype=bf16", "--set", "precision.master_dtype=bf16"] if master == "bf16" else [])
    base = ["--preset", "tiny-cpu", "--headless", "--set", f"model.name={model17m}",
            "--set", "fsdp.cpu_offload=true", "--set", "fsdp.host_arena=true", "--set", "train.steps=4",
            "--set", "train.log_every=1", "--set", "train.micro_batch=1", "--set", "train.checkpoint_every=2",
            "--set", f"train.checkpoint_dir={ckpt}", *prec]
    first = tmp_path / "first"
    res = shardconsole(*base, "--run-dir", str(first), timeout=400, env=RESIDENT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "host arena:" in (first / "logs" / "rank0.log").read_text()
    peaks = _peaks(first)
    assert sorted(peaks) == [(0, 2), (0, 4), (1, 2), (1, 4)]
    for (rank, step), p in peaks.items():
        per_rank_state = p["total"] / 2
        rise = p["save_peak"] - p["start"]
        assert per_rank_state > 60e6 if master == "fp32" else per_rank_state > 30e6
        assert rise < per_rank_state / 4, f"rank {rank} step {step}: +{rise / 2**20:.1f} MiB of " \
                                          f"{per_rank_state / 2**20:.1f} MiB state"
    progress = of_kind(messages(first), "save")
    assert [m.step for m in progress if m.done] == [2, 4]
    assert progress[-1].written_bytes >= progress[-1].total_bytes > 0

    shutil.rmtree(ckpt / "step_00000004")
    second = tmp_path / "second"
    res = shardconsole(*base, "--run-dir", str(second), "--set", "train.resume=true", timeout=400)
    assert res.returncode == 0, res.stderr[-2000:]
    want = [(m.step, m.loss, m.grad_norm) for m in of_kind(messages(first), "step")][2:]
    got = [(m.step, m.loss, m.grad_norm) for m in of_kind(messages(second), "step")]
    assert [s for s, *_ in got] == [3, 4] and got == want


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


def test_a_save_that_fills_the_disk_says_so_keeps_the_last_checkpoint_and_resume_continues(tmp_path):
    """checkpoint_dir on a tmpfs with room for one checkpoint of the tiny model (~1.8 MB): the save of
    step 2 fits, the one of step 4 fills the disk. The run fails as disk_full (exit 9) naming the step,
    the bytes needed and free, and the folder; step 2 is intact and its failed successor gone; with room
    made (the tmpfs grown, as a user frees space), `resume` continues from step 2 and finishes. Then
    export-model onto a full disk: one line, exit 2, and no folder that looks like an export."""
    ckpt = tmp_path / "ckpt"
    _mount_tmpfs(ckpt, "2700k")
    try:
        run = tmp_path / "run"
        # --force: the preflight refuses this folder (two checkpoints do not fit); the save must cope anyway
        res = shardconsole("--preset", "tiny-cpu", "--headless", "--force", "--run-dir", str(run), "--set", "train.steps=4",
                           "--set", "train.log_every=1", "--set", "train.checkpoint_every=2",
                           "--set", f"train.checkpoint_dir={ckpt}", timeout=300)
        assert res.returncode == 9, res.stdout[-2000:] + res.stderr[-2000:]
        failed = of_kind(messages(run), "failed")
        assert failed and {m.cause for m in failed} == {"disk_full"}, failed
        assert re.match(rf"disk full at the checkpoint of step 4: needs \d.* \S+, \d.* \S+ free on {ckpt}$",
                        failed[0].message), failed[0].message
        assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000002"]
        assert (ckpt / "step_00000002" / "shardconsole.json").is_file()

        subprocess.run(["mount", "-o", "remount,size=8m", str(ckpt)], check=True)
        res = shardconsole("resume", str(run), timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        steps = [m.step for m in of_kind(messages(run), "step")]
        assert steps == [1, 2, 3, 4, 3, 4]         # the resumed session continued from step 2
        assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000002", "step_00000004"]

        full = tmp_path / "full"
        _mount_tmpfs(full, "100k")                 # the tiny model's fp32 safetensors alone are ~530 kB
        try:
            res = shardconsole("export-model", str(run), "-o", str(full / "hf"), timeout=300)
            assert res.returncode == 2 and res.stdout == "", res.stdout + res.stderr
            # torch's own import-time warnings aside, the command says one line and no traceback
            lines = [line for line in res.stderr.splitlines() if line.startswith("shardconsole")]
            assert "Traceback" not in res.stderr, res.stderr
            assert len(lines) == 1 and "disk full" in lines[0] and str(full / "hf") in lines[0], res.stderr
            assert list(full.iterdir()) == []
        finally:
            subprocess.run(["umount", str(full)], check=False)
    finally:
        subprocess.run(["umount", str(ckpt)], check=False)


def test_export_dir_is_a_folder_transformers_loads_with_the_runs_eval_loss(tmp_path):
    """train.export_dir with save_final = "model": the run writes a weights-only checkpoint (export-model
    reads it, resume passes it by) and the Hugging Face folder straight from the trained state.
    transformers loads the folder with no missing or unexpected keys, and a run that starts from it and
    does not move the weights (lr 0) measures the run's last eval loss on the same held-out records."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.hf_fixtures import CORPUS, make_hf_model
    model = make_hf_model(tmp_path / "model")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{i}: {t}"}) + "\n" for i, t in enumerate(CORPUS[:60])))
    data = ["--set", f"data.path={corpus}", "--set", "data.seq_len=32", "--set", "data.eval_fraction=0.2",
            "--set", "train.micro_batch=2"]
    run, out = tmp_path / "run", tmp_path / "exported"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", f"model.name={model}",
                       *data, "--set", "train.steps=3", "--set", "train.save_final=model",
                       "--set", f"train.export_dir={out}", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    manifest = json.loads((run / "checkpoints" / "step_00000003" / "shardconsole.json").read_text())
    assert manifest["what"] == "model" and not any(k.startswith("optim") for k in _dcp_keys(run / "checkpoints" /
                                                                                            "step_00000003"))
    assert [m.what for m in of_kind(messages(run), "save") if m.done] == ["model", "export"]
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".exported.partial*"))
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert {p.dtype for p in hf.parameters()} == {torch.float32}      # fp32 masters: fp32, as export-model

    again = tmp_path / "again"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(again), "--set", f"model.name={out}",
                       *data, "--set", "train.steps=1", "--set", "train.lr=0", "--set", "train.save_final=none",
                       timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    trained, reloaded = of_kind(messages(run), "eval")[-1], of_kind(messages(again), "eval")[-1]
    assert reloaded.tokens == trained.tokens > 0
    assert abs(reloaded.loss - trained.loss) < 1e-5, (trained.loss, reloaded.loss)


def _dcp_keys(path: Path) -> list[str]:
    from shardconsole.backends.engine.fsdp_checkpoint import SafeReader
    return list(SafeReader(str(path)).read_metadata().state_dict_metadata)
