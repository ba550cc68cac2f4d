"""Issue 49: what a new user trips on, outside the console (the CLI's chat, attach, tune, data, resume,
the launch's hints). Each test fails without its fix; runs are real 2-rank CPU runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import shardconsole
from tests.hf_fixtures import make_hf_model


def _mute(folder: Path) -> Path:
    """A model whose every logit is 0: greedy decoding takes token 0, the tokenizer's end-of-sequence,
    first, so every answer is empty (a LoRA run or a small base that learned to stop at once)."""
    import torch
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert lm.config.eos_token_id == 0
    with torch.no_grad():
        lm.lm_head.weight.zero_()
    lm.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def mute_model(tmp_path_factory) -> Path:
    return _mute(make_hf_model(tmp_path_factory.mktemp("mute") / "model", chat_template=True))


def test_chat_says_so_when_the_model_answers_nothing(mute_model, tmp_path):
    out = shardconsole("chat", str(mute_model), "--prompt", "hi", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "nothing: the model ended its turn at once" in out.stdout, out.stdout
    # --base: both answers; the base (the same mute folder) says so too
    out = shardconsole("chat", str(mute_model), "--prompt", "hi", "--device", "cpu", "--base", str(mute_model))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split("> ")[0] for ln in lines] == ["model", "base"], out.stdout
    assert all("ended its turn at once" in ln for ln in lines), out.stdout


def test_interactive_chat_says_so_too(mute_model):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "shardconsole", "chat", str(mute_model), "--device", "cpu"],
                         input="hi\n", capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "model> (nothing: the model ended its turn at once" in out.stdout, out.stdout


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_attach_leaves_a_finished_run_as_it_was(fsdp_tiny_run, tmp_path):
    """Item 2 (and issue 45): attach replays a finished run and writes nothing into it: no machine sample
    after its `finished` line, no detached note, its TensorBoard file not rewritten."""
    import shutil
    assert fsdp_tiny_run.res.returncode == 0, fsdp_tiny_run.res.stderr[-2000:]
    run = tmp_path / fsdp_tiny_run.run.name
    shutil.copytree(fsdp_tiny_run.run, run)
    before = _files(run)
    out = shardconsole("attach", str(run), "--headless")
    assert out.returncode == 0, out.stderr
    assert "finished: 12 steps" in out.stderr and [ln for ln in out.stdout.splitlines() if ln.startswith("step ")]
    assert _files(run) == before


# --- item 8: a closed terminal detaches, said in the stream ----------------------------------------

def _tmux(sock: str, *args: str) -> str:
    import subprocess
    return subprocess.run(["tmux", "-L", sock, "-f", "/dev/null", *args], capture_output=True, text=True,
                          check=True, timeout=30).stdout


@pytest.mark.parametrize("front", ["headless", "console"])
def test_a_closed_terminal_detaches_and_says_so_in_the_stream(tmp_path, front):
    """tmux kill-session under a run's front end: the run goes on, metrics.jsonl gets a `detached` event
    (README's table), the front end exits."""
    import os
    import shlex
    import shutil
    import sys
    from tests.conftest import messages, of_kind, pids_alive, wait_for_steps, wait_until
    if shutil.which("tmux") is None:
        pytest.fail("tmux is needed for this test (apt-get install tmux)")
    sock, root = f"w49-{os.getpid()}-{front}", tmp_path / "runs"
    env = {k: os.environ[k] for k in os.environ if k.startswith("SHARDCONSOLE_") or k in (
        "PYTHONPATH", "DS_ACCELERATOR", "PATH", "HOME")}
    env["SHARDCONSOLE_RUNS_ROOT"] = str(root)
    argv = [sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--set", "train.steps=100000",
            "--set", "train.log_every=1"] + (["--headless", "--run-dir", str(root / "run")] if front == "headless" else [])
    command = "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)
    _tmux(sock, "new-session", "-d", "-s", "w", "-x", "120", "-y", "40", command)
    run = None
    try:
        pane_pid = int(_tmux(sock, "list-panes", "-t", "w", "-F", "#{pane_pid}").split()[0])
        if front == "console":
            wait_until(lambda: "Launch" in _tmux(sock, "capture-pane", "-p", "-t", "w"), 120, "the setup screen")
            _tmux(sock, "send-keys", "-t", "w", "C-r")
        run = wait_until(lambda: next(iter(root.glob("*/metrics.jsonl")), None), 120, "the run's stream").parent
        wait_for_steps(run, 2, 180)
        import psutil
        pane = psutil.Process(pane_pid)     # the front end: the pane's process or the shell's child
        front_pids = [p.pid for p in [pane, *pane.children(recursive=True)] if "shardconsole" in " ".join(p.cmdline())
                      and "backends" not in " ".join(p.cmdline()) and "torchrun" not in " ".join(p.cmdline())]
        assert front_pids, [p.cmdline() for p in [pane, *pane.children(recursive=True)]]
        _tmux(sock, "kill-session", "-t", "w")
        wait_until(lambda: not pids_alive(front_pids), 60, "the front end's exit")
        msgs = messages(run)
        detached = [e for e in of_kind(msgs, "event") if e.name == "detached"]
        assert len(detached) == 1 and "the terminal closed (SIGHUP)" in detached[0].detail, detached
        assert pids_alive(h.pid for h in of_kind(msgs, "hello")), "the run went with its terminal"
    finally:
        import subprocess
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
        if run is not None:
            shardconsole("stop", str(run), timeout=90)


# --- item 4: chat with an adapter folder (export-model --adapter) ----------------------------------

@pytest.fixture(scope="module")
def lora_exports(tmp_path_factory):
    """A 4-step LoRA run of a tiny HF folder, exported merged and as peft's adapter folder."""
    import json
    from types import SimpleNamespace
    from tests.hf_fixtures import CORPUS
    root = tmp_path_factory.mktemp("lora-chat")
    model = make_hf_model(root / "model", chat_template=True)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{i}: {t}"}) + "\n" for i, t in enumerate(CORPUS[:40])))
    run = root / "run"
    sets = [f"model.name={model}", f"data.path={corpus}", "data.seq_len=32", "train.steps=4", "train.method=lora",
            "lora.rank=4", "train.lr=0.05"]
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), *[a for s in sets for a in ("--set", s)],
                       timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    merged, adapter = root / "merged", root / "adapter"
    for out, extra in ((merged, []), (adapter, ["--adapter"])):
        res = shardconsole("export-model", str(run), "-o", str(out), *extra, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
    return SimpleNamespace(model=model, run=run, merged=merged, adapter=adapter)


def test_chat_loads_an_adapter_folder_onto_its_base(lora_exports):
    """README: chat takes an exported folder; an --adapter export is one. Its answer is the merged export's."""
    ask = ("--prompt", "what is two plus two?", "--max-new-tokens", "12", "--device", "cpu")
    merged = shardconsole("chat", str(lora_exports.merged), *ask)
    adapter = shardconsole("chat", str(lora_exports.adapter), *ask)
    assert merged.returncode == 0, merged.stderr
    assert adapter.returncode == 0, adapter.stderr
    assert adapter.stdout == merged.stdout and adapter.stdout.strip(), (adapter.stdout, merged.stdout)
    # --base: the folder the adapters go onto answers beside them
    both = shardconsole("chat", str(lora_exports.adapter), *ask, "--base")
    assert both.returncode == 0, both.stderr
    assert [ln.split("> ")[0] for ln in both.stdout.splitlines()] == ["model", "base"], both.stdout


def test_chat_on_an_adapter_whose_base_is_gone_says_what_to_do(lora_exports, tmp_path):
    import json
    import shutil
    adapter = tmp_path / "adapter"
    shutil.copytree(lora_exports.adapter, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "README.md").unlink()
    out = shardconsole("chat", str(adapter), "--prompt", "hi", "--device", "cpu")
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert "LoRA adapter folder" in line and str(tmp_path / "gone") in line and "export-model" in line, line


# --- item 5: tune --dry-run without a GPU -----------------------------------------------------------

def test_tune_dry_run_without_a_gpu_lists_the_options_for_the_presets_gpu():
    """A dry run measures nothing: on a machine without a GPU it plans for the preset's card
    (memory.gpu_memory_limit) or the one --gpu-memory names, ranked, the settings as given among them."""
    out = shardconsole("tune", "--preset", "3090-offload", "--dry-run", timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "1 GPU(s) of 24.0 GiB (the preset's memory.gpu_memory_limit; no GPU on this machine)" in lines[0], lines[0]
    fit = int(lines[1].split()[0])
    ranked = [float(ln.split()[0]) for ln in lines[2:] if ln.startswith("  ")]
    assert fit > 1 and len(ranked) > 1 and ranked == sorted(ranked, reverse=True), out.stdout
    assert any("[baseline] full_shard+offload" in ln for ln in lines), out.stdout
    small = shardconsole("tune", "--preset", "3090-offload", "--dry-run", "--gpu-memory", "12GiB", timeout=120)
    assert small.returncode == 0, small.stderr
    assert "1 GPU(s) of 12.0 GiB (--gpu-memory; no GPU on this machine)" in small.stdout
    assert int(small.stdout.splitlines()[1].split()[0]) < fit
    # a preset naming no card size: one line asking for it
    none = shardconsole("tune", "--preset", "h200-fsdp", "--dry-run", timeout=120)
    assert none.returncode == 2 and "Traceback" not in none.stderr, none.stderr
    assert "--gpu-memory SIZE" in none.stderr and len(none.stderr.strip().splitlines()) == 1, none.stderr


# --- item 10: where a value came from; the steps a resumed run had done ----------------------------

def test_data_preview_names_the_set_that_gave_a_bad_path(tmp_path):
    out = shardconsole("data", "--preview", "--set", f"data.path={tmp_path / 'missing.jsonl'}")
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert line.startswith("shardconsole: error: --set data.path: ") and "no such file" in line, line
    assert "preset:" not in line and len(line.splitlines()) == 1, line
    # from a preset file: that file is named
    preset = tmp_path / "mine.toml"
    preset.write_text(f'[model]\nname = "tiny"\n[data]\nsource = "auto"\npath = "{tmp_path / "gone.jsonl"}"\n')
    out = shardconsole("data", "--preview", "2", "--preset", str(preset))
    assert out.returncode == 2 and str(preset) in out.stderr and "gone.jsonl" in out.stderr, out.stderr


def test_resume_sums_up_the_earlier_steps_from_the_first_step_trained(tmp_path):
    """A 6-step run with a step line every 3 trained steps 1-6; its first step line is step 3."""
    run = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=6",
                       "--set", "train.log_every=3", "--set", "train.save_final=full")
    assert res.returncode == 0, res.stderr[-2000:]
    res = shardconsole("resume", str(run), "--set", "train.steps=9")
    assert res.returncode == 0, res.stderr[-2000:]
    first = res.stdout.splitlines()[0]
    assert first.startswith("earlier in this folder (1 session): steps 1-6, "), res.stdout
    # a second resume: the resumed session trained 7-9 (its first line, 9, is its last)
    res = shardconsole("resume", str(run), "--set", "train.steps=12")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines()[0].startswith("earlier in this folder (2 sessions): steps 1-9, "), res.stdout


# --- item 11: a Hub id without network, export-model --adapter of a full run ------------------------

def test_a_hub_model_id_says_to_download_it_first():
    out = shardconsole("--preset", "tiny-cpu", "--headless", "--set", "model.name=meta-llama/Llama-3.1-8B")
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("shardconsole: error: --set model.name: "), line
    assert "hf download meta-llama/Llama-3.1-8B --local-dir DIR" in line and 'model.name = "DIR"' in line, line
    # a path that is not there is still just that
    out = shardconsole("--preset", "tiny-cpu", "--headless", "--set", "model.name=./no/such/folder")
    assert out.returncode == 2 and "no such folder" in out.stderr and "hf download" not in out.stderr


def test_export_adapter_of_a_full_run_is_refused_before_torch_loads(fsdp_tiny_run, tmp_path):
    """The refusal comes from the settings alone: nothing of torch is imported for it (it took 9 s)."""
    import subprocess
    import sys
    code = ("import sys; from shardconsole.cli.main import main; rc = main(sys.argv[1:]); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch', rc)")
    out = subprocess.run([sys.executable, "-c", code, "export-model", str(fsdp_tiny_run.run), "-o", str(tmp_path / "x"),
                          "--adapter"], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["no", "torch", "2"], (out.stdout, out.stderr)
    assert "--adapter:" in out.stderr and "trained every weight" in out.stderr, out.stderr


def test_tiny_cpus_synthetic_data_says_its_loss_goes_to_zero(fsdp_tiny_run):
    """tiny-cpu trains on synthetic tokens, a pattern it memorises: its loss falls towards 0, and the data
    line says so rather than 'random tokens' (a user took a loss of 0.0000 for a bug)."""
    out = fsdp_tiny_run.res.stdout
    data = [ln for ln in out.splitlines() if ln.startswith("data: ")]
    assert len(data) == 1 and "random tokens" not in data[0], data
    assert "the loss falls towards 0" in data[0] and "nothing real is learned" in data[0], data
