"""LoRA beside full fine-tuning (issue 33), with real 2-rank CPU runs on a model folder made here.

One run per engine (FSDP2 with lora.modules_to_save = embed_tokens, DeepSpeed ZeRO-3 with the default
none: a frozen embedding once crashed ZeRO-3 at step 1), shared by every check of that engine:
  6 steps with an eval and a checkpoint at 3 and 6; the step-6 checkpoint is then removed and the run
  resumed from step 3, so the replayed steps 4-6 must equal the first session's (exact resume); the
  resumed run is exported merged and as an adapter folder by export-model, and by the run itself
  (train.export_dir: FSDP2 as peft's adapters, ZeRO-3 merged), and all give the run's last eval loss on
  its held-out windows through transformers and peft, not through our modules.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardconsole.settings import config as C
from tests.conftest import messages, of_kind, shardconsole
from tests.hf_fixtures import CORPUS, make_hf_model

RUN_TIMEOUT = 600
SETS = ["data.seq_len=32", "data.eval_fraction=0.2", "train.eval_every=3", "train.steps=6", "train.log_every=1",
        "train.checkpoint_every=3", "train.method=lora", "lora.rank=4", "train.peak_tflops=1"]       # an MFU on CPU: the step line's FLOPs a token read back from it


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = make_hf_model(root / "model", chat_template=True)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{i}: {t}"}) + "\n" for i, t in enumerate(CORPUS[:60])))
    return SimpleNamespace(root=root, model=model, corpus=corpus, env={
        "SHARDCONSOLE_CACHE_DIR": str(root / "cache"), "SHARDCONSOLE_RUNS_ROOT": str(root / "runs"),
        "DS_ACCELERATOR": "cpu"})


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def _lora_run(folder, name: str, *backend: str) -> SimpleNamespace:
    run, live = folder.root / name, folder.root / f"{name}-live"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *_sets(f"model.name={folder.model}", f"data.path={folder.corpus}", f"train.export_dir={live}",
                              *SETS, *backend),
                       timeout=RUN_TIMEOUT, env=folder.env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    first = {m.step: m.loss for m in of_kind(messages(run), "step")}
    shutil.rmtree(run / "checkpoints" / "step_00000006")         # resume from step 3, replaying 4..6
    live.rename(folder.root / f"{name}-live-first")               # the resumed session exports there again
    res = shardconsole("resume", str(run), timeout=RUN_TIMEOUT, env=folder.env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = of_kind(messages(run), "step")
    replayed = {m.step: m.loss for m in steps if m.run != steps[0].run}
    merged, adapter = folder.root / f"{name}-merged", folder.root / f"{name}-adapter"
    for out, extra in ((merged, []), (adapter, ["--adapter"])):
        res = shardconsole("export-model", str(run), "-o", str(out), *extra, timeout=300, env=folder.env)
        assert res.returncode == 0, res.stderr[-3000:]
    return SimpleNamespace(run=run, first=first, replayed=replayed, merged=merged, adapter=adapter, live=live)


@pytest.fixture(scope="module")
def fsdp(folder):
    return _lora_run(folder, "fsdp", "lora.modules_to_save=embed_tokens", "train.export_adapter=true")


@pytest.fixture(scope="module")
def zero3(folder):
    return _lora_run(folder, "zero3", "parallel.backend=deepspeed", "deepspeed.stage=3")


def held_out_loss(run: Path, env: dict, model) -> tuple[float, int]:
    """The mean loss of `model` (a transformers or peft model) over the windows the ranks evaluated."""
    import os

    from shardconsole.backends.data import batches as data, token_cache
    from shardconsole.settings.models import resolve
    cfg = C.load(run / "preset.toml")
    spec = resolve(cfg.model.name)
    os.environ["SHARDCONSOLE_CACHE_DIR"] = env["SHARDCONSOLE_CACHE_DIR"]
    entry = token_cache.open_entry(cfg.data, cfg.train.seed, spec.path, spec.has_tokenizer, spec.vocab, print)
    windows = data.EvalWindows(entry.eval.ids, entry.eval.flags, cfg.data.seq_len, 0, 1,
                               cfg.data.cross_document_attention)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in windows.batches(2):
            logits = model(input_ids=b.inputs, position_ids=b.positions, use_cache=False).logits.float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.labels.flatten(),
                                                       ignore_index=-100, reduction="sum").item()
            count += int((b.labels != -100).sum())
    return total / count, count


def assert_lora_run(got: SimpleNamespace, folder, monkeypatch) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", folder.env["SHARDCONSOLE_CACHE_DIR"])
    # trains: the loss falls; resumes exactly: steps 4..6 again from step 3's adapters and Adam state
    assert got.first[6] < got.first[1] - 0.1, got.first
    assert sorted(got.replayed) == [4, 5, 6]
    assert got.replayed == pytest.approx({s: got.first[s] for s in (4, 5, 6)}, abs=1e-5)
    # the checkpoint holds what trains: no frozen base weight in it
    from shardconsole.export_model.checkpoint import pick_checkpoint, read_model_state
    cfg = C.load(got.run / "preset.toml")
    held = read_model_state(pick_checkpoint(got.run / "checkpoints", 6, cfg.parallel.backend))
    assert held and all(".lora_A." in k or ".lora_B." in k or ".modules_to_save." in k for k in held), sorted(held)
    last = of_kind(messages(got.run), "eval")[-1]
    assert last.step == 6
    assert_mfu_counts_what_lora_computes(got.run, folder.model)
    # merged: a plain transformers model folder
    merged = AutoModelForCausalLM.from_pretrained(got.merged, dtype=torch.float32).eval()
    loss, count = held_out_loss(got.run, folder.env, merged)
    assert count == last.tokens and abs(loss - last.loss) < 1e-3, (loss, last.loss)
    # adapter folder: peft puts it onto the base, with the run's tokenizer and chat template beside it
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in got.adapter.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(folder.model, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, got.adapter).eval()
    loss, _ = held_out_loss(got.run, folder.env, adapted)
    assert abs(loss - last.loss) < 1e-3, (loss, last.loss)
    # the run's own export (train.export_dir), written from the live state at the last step
    if cfg.train.export_adapter:
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in got.live.iterdir()}
        base = AutoModelForCausalLM.from_pretrained(folder.model, dtype=torch.float32)
        live = PeftModel.from_pretrained(base, got.live).eval()
    else:
        live = AutoModelForCausalLM.from_pretrained(got.live, dtype=torch.float32).eval()
        from safetensors.torch import load_file
        ours, theirs = load_file(got.live / "model.safetensors"), load_file(got.merged / "model.safetensors")
        assert set(ours) == set(theirs)
        assert max((ours[k].float() - theirs[k].float()).abs().max().item() for k in ours) < 1e-6
    loss, _ = held_out_loss(got.run, folder.env, live)
    assert abs(loss - last.loss) < 1e-3, (loss, last.loss)


def assert_mfu_counts_what_lora_computes(run: Path, model: Path) -> None:
    """The step line's MFU, read back as FLOPs a token: 4 per frozen base weight (forward + the gradient to
    its input), 6 per trained one, none for the embedding's frozen original (modules_to_save copies it),
    and attention's 12 L h s, against full fine-tuning's 6N + 12 L h s."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from shardconsole.backends.model.adapters import lora_config
    cfg = C.load(run / "preset.toml")
    base = AutoModelForCausalLM.from_pretrained(model)
    n = sum(p.numel() for p in base.parameters())
    h, layers = base.config.hidden_size, base.config.num_hidden_layers
    saved = base.config.vocab_size * h if "embed_tokens" in cfg.lora.modules_to_save else 0   # trained whole
    trained, _ = get_peft_model(base, lora_config(cfg)).get_nb_trainable_parameters()
    attention = 12 * layers * h * cfg.data.seq_len
    expected, full = 4 * (n - saved) + 6 * trained + attention, 6 * n + attention
    step = of_kind(messages(run), "step")[-1]
    got = step.mfu * 1e12 * cfg.world_size / step.tokens_per_s
    assert got == pytest.approx(expected, rel=1e-6) and got < full, (got, expected, full)


@pytest.mark.slow
def test_fsdp_lora_trains_resumes_exactly_and_exports_both_ways(fsdp, folder, monkeypatch):
    assert_lora_run(fsdp, folder, monkeypatch)


@pytest.mark.slow
def test_zero3_lora_trains_resumes_exactly_and_exports_both_ways(zero3, folder, monkeypatch):
    assert_lora_run(zero3, folder, monkeypatch)


def _one_line_error(res) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardconsole: error: "), res.stderr
    return lines[0]


def test_qlora_is_refused_before_launch_on_a_machine_without_cuda(tmp_path):
    for device in ("cpu", "auto"):
        res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / device),
                           *_sets("train.method=qlora", f"parallel.device={device}", "precision.dtype=bf16"))
        line = _one_line_error(res)
        assert "train.method" in line and "CUDA" in line, line
        assert not (tmp_path / device / "metrics.jsonl").exists()


def test_the_planners_trainable_count_is_peft_s(tmp_path):
    """plan/lora.py counts from the model's shape what peft's injection makes trainable."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from shardconsole.backends.model.adapters import lora_config
    from shardconsole.plan import lora
    from shardconsole.plan.shapes import Shapes
    from shardconsole.settings.models import resolve
    model = make_hf_model(tmp_path / "model")
    for targets, saved in (("all-linear", ""), ("q_proj,v_proj", "embed_tokens,lm_head"), ("down_proj", "")):
        cfg = C.build({"model": {"name": str(model)}, "train": {"method": "lora"},
                       "lora": {"rank": 8, "target_modules": targets, "modules_to_save": saved}})
        spec = resolve(cfg.model.name)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model), lora_config(cfg))
        trainable, _ = peft_model.get_nb_trainable_parameters()
        assert lora.trainable_params(cfg, Shapes.of(spec)) == trainable, (targets, saved)


async def test_the_console_picks_the_method_on_the_first_tab_and_shows_the_lora_form(tmp_path):
    """The Method switch on the Pick tab sets train.method; [lora] is a form tab only when adapters train;
    the plan line says what trains."""
    from textual.widgets import TabbedContent

    import shardconsole.plan as plan
    from shardconsole.console.widgets.setting_field import SettingField
    from tests.test_console import make_app, show_table, text_of
    app = make_app(tmp_path, planner=lambda: plan)
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        tabs = setup.query_one(TabbedContent)
        assert setup.cfg.train.method == "full" and tabs.get_tab("tab-lora").has_class("-hidden")
        await pilot.click("#method-lora")
        await pilot.pause()
        assert setup.cfg.train.method == "lora" and not tabs.get_tab("tab-lora").has_class("-hidden")
        assert "train.method full → lora" in text_of(setup.query_one("#changes"))
        await show_table(pilot, setup, "lora")
        assert setup.query_one("#field-lora-target_modules", SettingField)
        deadline = 100
        while "trainable" not in text_of(setup.query_one("#estimate")) and deadline:
            await pilot.pause(0.05)
            deadline -= 1
        assert "lora: 39.4K of 133.4K trainable" in text_of(setup.query_one("#estimate"))


def test_qloras_random_base_is_made_a_layer_at_a_time_and_equals_the_lora_runs_base(monkeypatch):
    """backends/qlora.random_base: when a layer is quantised no other decoder layer is materialised (the
    quantiser here snapshots the layer's bf16 draw and sends it back to meta, as quantising frees it),
    and the draws equal init_random_'s on a whole LoRA-injected model (a 1-rank FSDP2 LoRA run's base)."""
    from transformers import LlamaConfig

    from shardconsole.backends.model import adapters, modeling, qlora
    hf_cfg = LlamaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=48, vocab_size=96, initializer_range=0.3)
    hf_cfg._attn_implementation = "sdpa"
    cfg = C.build({"train": {"method": "lora", "seed": 5}, "lora": {"rank": 4, "modules_to_save": "embed_tokens"}})
    layers, drawn = [], {}
    real = modeling.decoder_layers

    def capture(lm):
        layers[:] = real(lm)
        return layers
    monkeypatch.setattr(modeling, "decoder_layers", capture)

    def stand_in(layer, device):
        i = layers.index(layer)
        assert [j for j, other in enumerate(layers) if not next(other.parameters()).is_meta] == [i]
        drawn.update({f"model.layers.{i}.{k}": v.clone() for k, v in layer.state_dict().items()})
        layer.to_empty(device="meta")
        return 7
    lm, count = qlora.random_base(hf_cfg, torch.device("cpu"), 5, quantise=stand_in)
    assert count == 7 * 3 and len(drawn) == 3 * 9
    drawn.update({k: v for k, v in lm.state_dict().items() if ".layers." not in k})
    torch.set_default_dtype(torch.bfloat16)
    try:
        whole = modeling.CausalLMLoss(modeling.build_causal_lm(hf_cfg))
    finally:
        torch.set_default_dtype(torch.float32)
    adapters.inject(whole.lm, cfg)
    modeling.init_random_(whole, 0.3, 5, 0)
    base = {adapters.base_key(k[3:]): v for k, v in whole.state_dict().items()
            if not adapters.is_trained(k) and "rotary" not in k}
    assert sorted(base) == sorted(k for k in drawn if "rotary" not in k)
    for k, v in base.items():
        assert v.dtype == torch.bfloat16 and torch.equal(drawn[k], v), k


@pytest.mark.slow
def test_a_lora_resume_with_another_rank_or_method_names_the_setting_before_launch(fsdp, folder):
    """The checkpoint's adapters were made with lora.rank = 4 by train.method = lora: a resume that changes
    either is refused before any rank starts, naming the setting (it failed after launch with DCP's "Size
    mismatch ... move that folder away")."""
    preset = (fsdp.run / "preset.toml").read_text()
    lines = len((fsdp.run / "metrics.jsonl").read_text().splitlines())
    for override, said in (("lora.rank=8", "lora.rank = 4"), ("train.method=full", "train.method = 'lora'")):
        adapter = str(override.startswith("lora")).lower()     # a full run exports no adapter: refused apart
        res = shardconsole("resume", str(fsdp.run), *_sets("train.steps=8", override, "train.export_dir=",
                                                           f"train.export_adapter={adapter}"), timeout=120, env=folder.env)
        line = _one_line_error(res)
        assert f"--set {override.split('=')[0]}" in line and f"saved with {said}" in line, line
    assert (fsdp.run / "preset.toml").read_text() == preset           # nothing written, no rank started
    assert len((fsdp.run / "metrics.jsonl").read_text().splitlines()) == lines
