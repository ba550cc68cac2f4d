"""`shardconsole export-model`: real 2-rank CPU runs exported with the real CLI, then loaded by transformers.

Three runs, one per checkpoint writer (module fixtures, a few steps each):
- FSDP2 from a make_hf_model folder (chat template, tokenizer) on a .jsonl with a held-out split, a
  checkpoint at step 2 and the final one at 4;
- DeepSpeed ZeRO-3 in fp32 on the catalog's tiny model;
- DeepSpeed ZeRO-2 in bf16 with bf16 master weights, from a folder whose embeddings are tied and whose
  tokenizer has no chat template, on chats (so the run renders them with the plain template).
The expected tensors come from the checkpoint read by torch's and DeepSpeed's own converters
(dcp_to_torch_save, zero_to_fp32), never by the code under test.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardconsole.runlog.checkpoint_files import file_checksum, manifest_checksum

from shardconsole.settings import config as C
from tests.conftest import ZERO3_TINY_STEPS, messages, of_kind, shardconsole
from tests.hf_fixtures import CORPUS, make_hf_model

pytestmark = pytest.mark.slow
RUN_TIMEOUT = 900          # a cold machine builds DeepSpeed's ops inside the first DeepSpeed run


def _run(run_dir: Path, cache: Path, *sets: str) -> None:
    args = ["--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir), "--set", "train.save_final=true"]
    for s in sets:
        args += ["--set", s]
    res = shardconsole(*args, timeout=RUN_TIMEOUT, env={"SHARDCONSOLE_CACHE_DIR": str(cache),
                                                         "DS_ACCELERATOR": "cpu"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _export(run_dir: Path, out: Path, *extra: str):
    return shardconsole("export-model", str(run_dir), "-o", str(out), *extra, timeout=300)


def _exported(run_dir: Path, out: Path, *extra: str) -> Path:
    res = _export(run_dir, out, *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, fsdp_chat_run):
    """conftest's shared FSDP2 run from a Hugging Face folder (checkpoints at 2 and 4), exported here."""
    root = tmp_path_factory.mktemp("export-fsdp")
    out = _exported(fsdp_chat_run.run, root / "hf", "--max-shard-size", "100KB")    # ~0.6 MB of fp32: several files
    return SimpleNamespace(root=root, run=fsdp_chat_run.run, model=fsdp_chat_run.model, out=out,
                           cache=fsdp_chat_run.cache)


@pytest.fixture(scope="module")
def zero3(tmp_path_factory, zero3_tiny_run):
    """conftest's shared ZeRO-3 run (its final save at step ZERO3_TINY_STEPS), exported here; the tests
    read its folder, and the one that edits a checkpoint edits a copy."""
    res = zero3_tiny_run.res
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    root = tmp_path_factory.mktemp("export-zero3")
    return SimpleNamespace(root=root, run=zero3_tiny_run.run, step=ZERO3_TINY_STEPS,
                           out=_exported(zero3_tiny_run.run, root / "hf"))


@pytest.fixture(scope="module")
def zero2_bf16_tied(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-zero2")
    model = make_hf_model(root / "model", tie_word_embeddings=True)
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant",
                                                                                      "content": a}]}) + "\n"
                             for q, a in zip(CORPUS[:40:2], CORPUS[1:40:2])))
    run_dir = root / "run"
    _run(run_dir, root / "cache", f"model.name={model}", "parallel.backend=deepspeed", "deepspeed.stage=2",
         "precision.dtype=bf16", "precision.master_dtype=bf16", "train.steps=4", f"data.path={chats}",
         "data.seq_len=32")
    return SimpleNamespace(root=root, run=run_dir, model=model, out=_exported(run_dir, root / "hf"))


# ---------------------------------------------------------------------------------------------------
# The checkpoint as torch and DeepSpeed read it, and the trained module around it

def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def dcp_model_state(ckpt: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(ckpt), str(tmp / "full.pt"))
    return torch.load(tmp / "full.pt", weights_only=False)["model"]


def zero_model_state(ckpt: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def trained_module(run_dir: Path, state: dict):
    """CausalLMLoss(lm) as the ranks build it, holding the checkpoint's weights (strict: every key)."""
    from shardconsole.backends.model import modeling
    from shardconsole.settings.models import resolve
    cfg = C.load(run_dir / "preset.toml")
    hf_cfg = modeling.hf_config(resolve(cfg.model.name), cfg)
    module = modeling.CausalLMLoss(modeling.build_causal_lm(hf_cfg))
    module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return module.eval()


def load_export(out: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=dtype)
    assert {k: v for k, v in info.items() if v} == {}, info       # no missing, unexpected or mismatched key
    return model.eval()


def fixed_batch(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (2, 33), generator=g)


def assert_same_loss(run_dir: Path, state: dict, hf_model) -> None:
    """The exported model's loss on a fixed batch (transformers' own labels= path, which shifts) equals
    the trained module's on the same tokens."""
    x = fixed_batch(hf_model.config.vocab_size)
    with torch.no_grad():
        ours = trained_module(run_dir, state)(x[:, :-1], x[:, 1:]).item()
        theirs = hf_model(input_ids=x, labels=x).loss.item()
    assert abs(ours - theirs) < 1e-3, (ours, theirs)


# ---------------------------------------------------------------------------------------------------
# FSDP2

def test_fsdp_export_loads_whole_with_the_checkpoints_tensors(fsdp, tmp_path):
    files = sorted(p.name for p in fsdp.out.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "README.md"} <= set(files)
    assert len([f for f in files if f.endswith(".safetensors")]) > 1          # --max-shard-size 100KB
    assert not [p for p in fsdp.root.iterdir() if p.name.startswith(".hf")]    # no temporary folder left
    hf = load_export(fsdp.out)
    state = dcp_model_state(_step_dir(fsdp.run, 4), tmp_path)
    exported = hf.state_dict()
    assert set(exported) == {k.removeprefix("lm.") for k in state}
    for key, value in state.items():
        assert torch.equal(exported[key.removeprefix("lm.")], value), key
    assert_same_loss(fsdp.run, state, hf)


def test_fsdp_export_keeps_the_folders_tokenizer_and_architecture(fsdp):
    from transformers import AutoConfig, AutoTokenizer
    src_tok, out_tok = AutoTokenizer.from_pretrained(fsdp.model), AutoTokenizer.from_pretrained(fsdp.out)
    text = "Sharded training keeps parameters split across ranks."
    assert out_tok(text)["input_ids"] == src_tok(text)["input_ids"]
    assert out_tok.chat_template == src_tok.chat_template and out_tok.eos_token == "<|endoftext|>"
    src_cfg, out_cfg = AutoConfig.from_pretrained(fsdp.model), AutoConfig.from_pretrained(fsdp.out)
    assert out_cfg.architectures == src_cfg.architectures == ["LlamaForCausalLM"]
    for key in ("vocab_size", "max_position_embeddings", "eos_token_id", "pad_token_id", "hidden_size"):
        assert getattr(out_cfg, key) == getattr(src_cfg, key), key
    assert out_cfg.max_position_embeddings == 1024          # the folder's, not the catalog tiny's 2048


def test_exported_loss_on_the_eval_set_equals_the_runs_last_eval_loss(fsdp, monkeypatch):
    """The issue's check: the held-out windows the ranks evaluated (C's token cache, the run's own
    settings), through the exported model in fp32 on the CPU, give the run's last eval loss."""
    from shardconsole.backends.data import batches as data, token_cache
    from shardconsole.settings.models import resolve
    last = of_kind(messages(fsdp.run), "eval")[-1]
    assert last.step == 4
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(fsdp.cache))
    cfg = C.load(fsdp.run / "preset.toml")
    spec = resolve(cfg.model.name)
    entry = token_cache.open_entry(cfg.data, cfg.train.seed, spec.path, spec.has_tokenizer, spec.vocab, print)
    windows = data.EvalWindows(entry.eval.ids, entry.eval.flags, cfg.data.seq_len, 0, 1,
                               cfg.data.cross_document_attention)
    hf = load_export(fsdp.out)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in windows.batches(2):
            logits = hf(input_ids=b.inputs, position_ids=b.positions, use_cache=False).logits.float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.labels.flatten(),
                                                       ignore_index=-100, reduction="sum").item()
            count += int((b.labels != -100).sum())
    assert count == last.tokens
    assert abs(total / count - last.loss) < 1e-3, (total / count, last.loss)


def test_readme_holds_the_settings_and_the_last_eval_loss(fsdp):
    readme = (fsdp.out / "README.md").read_text()
    last = of_kind(messages(fsdp.run), "eval")[-1]
    assert f"{last.loss:.4f} at step 4" in readme
    assert (fsdp.run / "preset.toml").read_text().strip() in readme
    assert "step 4" in readme and str(fsdp.model) in readme


def test_step_picks_an_earlier_checkpoint(fsdp, tmp_path):
    out = _exported(fsdp.run, tmp_path / "step2", "--step", "2", "--dtype", "bf16")
    hf = load_export(out, dtype=None)
    state = dcp_model_state(_step_dir(fsdp.run, 2), tmp_path)
    for key, value in state.items():
        got = hf.state_dict()[key.removeprefix("lm.")]
        assert got.dtype == torch.bfloat16 and torch.equal(got, value.to(torch.bfloat16)), key
    assert not torch.equal(state["lm.lm_head.weight"],
                           dcp_model_state(_step_dir(fsdp.run, 4), tmp_path)["lm.lm_head.weight"])
    evals = {e.step: e.loss for e in of_kind(messages(fsdp.run), "eval")}
    assert f"{evals[2]:.4f} at step 2" in (out / "README.md").read_text()   # not step 4's: other weights


def test_an_export_named_with_250_characters_is_written(fsdp, tmp_path):
    """-o with a 250-character name (NAME_MAX is 255): the hidden folder it is written in first took the whole
    name with a prefix and a suffix and failed on its own name (issue 46 item 7)."""
    out = tmp_path / ("e" * 250)
    res = _export(fsdp.run, out, "--step", "2")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert (out / "config.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_an_incomplete_newest_checkpoint_is_skipped(fsdp, tmp_path):
    """A newest step folder cut short (a full disk, a copy stopped midway) is not exported by default:
    the one before is, with a line saying why; asked for by --step it is refused in one line."""
    run = tmp_path / "run"
    shutil.copytree(fsdp.run, run)
    shard = next(_step_dir(run, 4).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert "not a complete checkpoint" in _one_line_error(_export(run, tmp_path / "x", "--step", "4"))
    res = _export(run, tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert "skipping" in res.stderr and "step_00000004" in res.stderr and "truncated" in res.stderr
    assert "from step 2" in res.stdout
    assert not (tmp_path / "x").exists()


def test_a_killed_exports_partial_folder_is_removed_by_the_next_export(fsdp, tmp_path):
    """Issue 31 item 11: an export killed with SIGKILL leaves .OUT.partial-PID (its finally never ran);
    the next export into that folder removes it, and leaves the one of an export still writing."""
    import subprocess
    import sys
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    left = tmp_path / f".hf.partial-{killed.pid}"
    left.mkdir()
    (left / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    killed.kill()
    killed.wait()
    writing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "export-model"])
    try:
        kept = tmp_path / f".other.partial-{writing.pid}"
        kept.mkdir()
        _exported(fsdp.run, tmp_path / "hf")
        assert not left.exists() and kept.is_dir()
    finally:
        writing.kill()
        writing.wait()


# ---------------------------------------------------------------------------------------------------
# DeepSpeed

def test_zero3_export_loads_whole_with_the_checkpoints_tensors(zero3):
    hf = load_export(zero3.out)
    state = zero_model_state(_step_dir(zero3.run, zero3.step))
    exported = hf.state_dict()
    assert set(exported) == {k.removeprefix("lm.") for k in state}
    for key, value in state.items():
        assert value.dtype == torch.float32 and torch.equal(exported[key.removeprefix("lm.")], value), key
    assert_same_loss(zero3.run, state, hf)
    readme = (zero3.out / "README.md").read_text()
    assert "none was recorded" in readme and "DeepSpeed ZeRO stage 3" in readme
    assert not any((zero3.out / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_pickle_that_would_run_code_is_refused(zero3, tmp_path):
    """zero_to_fp32 itself loads with weights_only=False; the export forces weights_only on every load."""
    run = tmp_path / "run"
    shutil.copytree(zero3.run, run)
    marker = tmp_path / "ran"
    # rank 1's file: only zero_to_fp32 reads it (the export reads rank 0's for the stage, weights_only itself)
    step = _step_dir(run, zero3.step)
    states = sorted((step / f"global_step{zero3.step}").glob("*model_states.pt"))[-1]
    sd = torch.load(states, weights_only=False)
    sd["extra"] = _RunsCode(marker)
    torch.save(sd, states)
    manifest = step / "shardconsole.json"      # a crafted file comes with a matching manifest
    meta = json.loads(manifest.read_text())
    meta["files"][str(states.relative_to(step))] = states.stat().st_size
    meta["checksums"][str(states.relative_to(step))] = file_checksum(states)
    meta["manifest_checksum"] = manifest_checksum(meta)
    manifest.write_text(json.dumps(meta))
    line = _one_line_error(_export(run, tmp_path / "out"))
    assert "cannot read the checkpoint" in line and "weights_only" not in line, line   # never torch's advice
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_zero2_bf16_masters_and_tied_embeddings(zero2_bf16_tied, tmp_path):
    """bf16 masters come out as they are (bf16 by default, exact); the tied head is the embedding."""
    state = zero_model_state(_step_dir(zero2_bf16_tied.run, 4))
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    hf = load_export(zero2_bf16_tied.out, dtype=None)
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight
    for key, value in state.items():
        got = hf.state_dict()[key.removeprefix("lm.")]
        assert got.dtype == torch.bfloat16 and torch.equal(got, value), key
    fp32 = load_export(_exported(zero2_bf16_tied.run, tmp_path / "fp32", "--dtype", "fp32"))
    assert fp32.model.embed_tokens.weight.dtype == torch.float32
    assert_same_loss(zero2_bf16_tied.run, state, fp32)


def test_the_export_prompts_with_the_template_the_run_trained_with(zero2_bf16_tied):
    """The folder's tokenizer has no chat template, so the run rendered its chats with the plain one: the
    export carries it (apply_chat_template prompts as the run trained) and its README names it."""
    from transformers import AutoTokenizer
    from shardconsole.backends.data.corpus import PLAIN_TEMPLATE
    assert [d.template for d in of_kind(messages(zero2_bf16_tied.run), "data")] == ["shardconsole-plain"]
    tok = AutoTokenizer.from_pretrained(zero2_bf16_tied.out)
    assert tok.chat_template == PLAIN_TEMPLATE
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == "User: hi\n\nAssistant: "
    assert "- prompt format: shardconsole-plain" in (zero2_bf16_tied.out / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written

def _one_line_error(res) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardconsole: error: "), res.stderr
    return lines[0]


def test_refusals_are_one_line_and_write_nothing(fsdp, tmp_path):
    out = tmp_path / "out"
    assert "--step 3" in _one_line_error(_export(fsdp.run, out, "--step", "3"))
    assert "--max-shard-size 0: a size above 0" in _one_line_error(_export(fsdp.run, out, "--max-shard-size", "0"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert "not an empty folder" in _one_line_error(_export(fsdp.run, tmp_path / "full"))
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    fresh = tmp_path / "fresh"                 # a run folder whose run wrote no checkpoint yet
    res = shardconsole("--preset", "tiny-cpu", "--print-command", "--run-dir", str(fresh))
    assert res.returncode == 0, res.stderr
    assert "no checkpoint" in _one_line_error(_export(fresh, out))
    assert "not a run folder" in _one_line_error(_export(tmp_path / "nowhere", out))
    (tmp_path / "a-file").write_text("")
    assert "writing failed" in _one_line_error(_export(fsdp.run, tmp_path / "a-file" / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "fresh", "full"]


def test_an_export_onto_a_full_disk_is_one_line(fsdp, tmp_path):
    """Issue 31 item 8: a tmpfs too small for the weights: safetensors' own error (os error 28) was a
    traceback and exit 1; now one line, exit 2, and nothing half-written left there."""
    import subprocess
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
    try:
        res = _export(fsdp.run, mnt / "hf")
        assert res.returncode == 2, res.stderr[-3000:]
        assert "Traceback" not in res.stderr, res.stderr[-3000:]
        # torch's import may warn on stderr first (torchao's optional kernels); ours is one line
        [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("shardconsole:")]
        assert "writing failed" in line and "no space left" in line.lower(), line
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
