"""Preference training before the ranks: the settings and their refusals, the records' rules (one line naming
file, line and field, before launch), the pairs as rows (masks on the answers only, a pair never split,
the prompt cut from the left), resume by seek, and the reference switch of LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.settings.data.data_check import check_data

PAIRS = [{"prompt": f"Question {i}: say yes or no.", "chosen": " yes" * (1 + i % 3), "rejected": " no"}
         for i in range(12)]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def dpo_cfg(path: Path, *more: str) -> C.RunConfig:
    return settings.resolve("tiny-cpu", [f"data.path={path}", "train.objective=dpo", *more]).cfg


# --- settings ------------------------------------------------------------------------------------------

def test_objective_and_preference_table_resolve(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    cfg = dpo_cfg(data, "preference.beta=0.2", "preference.loss=ipo")
    assert (cfg.train.objective, cfg.preference.beta, cfg.preference.loss) == ("dpo", 0.2, "ipo")
    assert cfg.rows_per_sample == 2
    assert cfg.tokens_per_step == 2 * settings.resolve("tiny-cpu", [f"data.path={data}"]).cfg.tokens_per_step
    assert settings.resolve("tiny-cpu").cfg.train.objective == "sft"


@pytest.mark.parametrize("sets,key,words", [
    (["train.objective=dpo"], "train.objective", "set data.path"),
    (["train.objective=orpo", "data.source=synthetic"], "train.objective", "synthetic tokens"),
    (["train.objective=dpo", "DATA", "preference.loss=ipo", "preference.label_smoothing=0.1"],
     "preference.label_smoothing", "the ipo loss has no label smoothing"),
    (["train.objective=orpo", "DATA", "preference.label_smoothing=0.1"], "preference.label_smoothing", "ORPO"),
    (["train.objective=dpo", "DATA", "preference.loss=hinge"], "preference.loss", "sigmoid"),
])
def test_combinations_that_cannot_work_are_refused_in_one_line(tmp_path, sets, key, words):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    sets = [f"data.path={data}" if s == "DATA" else s for s in sets]
    with pytest.raises(C.ConfigError) as e:
        settings.resolve("tiny-cpu", sets)
    msg = str(e.value)
    assert "\n" not in msg and words in msg and key.split(".")[1] in msg


def test_sft_on_a_pairs_file_says_which_objective_takes_it(tmp_path):
    """The default objective (sft) on chosen/rejected records: the refusal names the setting that trains
    on them (issue 65), in one line."""
    from tests.conftest import shardconsole
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"),
                       "--set", f"data.path={data}")
    line = res.stderr.strip()
    assert res.returncode == 2 and len(line.splitlines()) == 1 and "Traceback" not in line, res.stderr
    assert "no known record format" in line and "train.objective=dpo" in line, line


# --- records, before launch --------------------------------------------------------------------------

@pytest.mark.parametrize("bad,where", [
    ({"prompt": "p", "chosen": "a"}, "field 'rejected': missing"),
    ({"prompt": "p", "chosen": "  ", "rejected": "b"}, "field 'chosen': empty answer"),
    ({"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "b"}]},
     "field 'rejected'[0]: differs from 'chosen'[0]"),
    ({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": ""}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "field 'chosen'[0].content: empty answer"),
])
def test_bad_records_are_named_by_file_line_and_field_before_launch(tmp_path, bad, where):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS[:3] + [bad] + PAIRS[3:])
    cfg = dpo_cfg(data)
    with pytest.raises(C.ConfigError) as e:
        check_data(cfg)
    msg = str(e.value)
    assert f"{data}:4: {where}" in msg and "\n" not in msg


def test_good_records_pass_the_check_in_both_forms(tmp_path):
    conv = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}],
             "chosen": [{"role": "assistant", "content": "yes"}], "rejected": [{"role": "assistant", "content": "no"}]}
            for i in range(3)]
    implicit = [{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "yes"}],
                 "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "no"}]}]
    for name, recs in (("s", PAIRS), ("c", conv), ("i", implicit)):
        found = check_data(dpo_cfg(write_jsonl(tmp_path / f"{name}.jsonl", recs)))
        assert found.records == len(recs) and found.format == "preference"


# --- pairs to rows ------------------------------------------------------------------------------------

def test_rows_mask_only_the_answers_and_cut_the_prompt_from_the_left():
    from shardconsole.backends.data import pair_tokens as T
    from shardconsole.backends.data import preference as D
    t = T.PairTokens(prompt=[1, 2, 3, 4, 5, 6], chosen=[7, 8, 0], rejected=[9, 0])
    fitted, cut = T.fit(t, seq_len=6)          # rows of 7 tokens: 3 for the longer answer, 4 of the prompt
    assert cut and fitted.prompt == [3, 4, 5, 6] and fitted.chosen == [7, 8, 0] and fitted.rejected == [9, 0]
    ids = np.asarray(fitted.prompt + fitted.chosen + fitted.rejected, dtype=np.uint16)
    split = D.PairSplit(ids, np.asarray([[0, 4, 3, 2]], dtype=np.int64))
    batch = D.to_batch(split, [0, -1], seq_len=6)
    assert batch.inputs.shape == (4, 6) and batch.pairs.tolist() == [0, -1]
    # chosen row 0: inputs 3 4 5 6 7 8, labels the answer's tokens after the prompt: 7 8 0
    assert batch.inputs[0].tolist() == [3, 4, 5, 6, 7, 8]
    assert batch.labels[0].tolist() == [-100, -100, -100, 7, 8, 0]
    assert batch.inputs[2, :5].tolist() == [3, 4, 5, 6, 9]             # rejected row of the same pair
    assert batch.labels[2].tolist() == [-100, -100, -100, 9, 0, -100]   # then padding, no label
    assert (batch.labels[1] == -100).all() and (batch.labels[3] == -100).all()    # the empty pair


def test_source_resumes_exactly_by_seek_on_any_rank_count():
    from shardconsole.backends.data import preference as D
    n = 10
    index = np.asarray([[3 * k, 1, 1, 1] for k in range(n)], dtype=np.int64)
    split = D.PairSplit(np.arange(3 * n, dtype=np.uint16), index)
    one = D.PairSource(split, 4, seed=7, rank=0, world=1, name="x")
    order = [int(p) for _ in range(7) for p in one.batch(3).pairs]
    assert sorted(order[:n]) == list(range(n))                   # an epoch is every pair once
    two = [D.PairSource(split, 4, seed=7, rank=r, world=2, name="x") for r in (0, 1)]
    for s in two:
        s.seek(6)
    after = [int(s.batch(1).pairs[0]) for s in two]
    assert after == order[6:8]


def test_the_pair_cache_opens_an_empty_split(tmp_path, monkeypatch):
    """An entry whose eval split holds no tokens (a cache edited by hand, or cut short): np.memmap refuses an
    empty file, so the reader maps nothing and gives a split of no pairs, as the token cache's reader does."""
    import json as _json
    from shardconsole.backends.data import preference as D
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = dpo_cfg(write_jsonl(tmp_path / "p.jsonl", PAIRS), "data.eval_fraction=0.25", "data.seq_len=32")
    first = D.open_entry(cfg.data, 1, None, False, 512, lambda _: None)
    assert first.eval is not None and first.eval.n == 3
    meta = _json.loads((first.folder / "meta.json").read_text())
    meta["splits"]["eval"] = {**meta["splits"]["eval"], "records": 0, "tokens": 0}
    (first.folder / "meta.json").write_text(_json.dumps(meta))
    for part in ("ids", "index"):
        (first.folder / f"eval.{part}").write_bytes(b"")
    again = D.open_entry(cfg.data, 1, None, False, 512, lambda _: None)
    assert again.eval is not None and again.eval.n == 0 and len(again.eval.ids) == 0 and again.train.n == 9


def test_lora_reference_is_the_base_with_adapters_off():
    from transformers import LlamaConfig, LlamaForCausalLM
    from shardconsole.backends.model import adapters, modeling
    cfg = settings.resolve("tiny-cpu", ["train.method=lora", "lora.rank=4"]).cfg
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=64, vocab_size=64))
    ids = torch.randint(0, 64, (2, 8))
    labels = torch.roll(ids, -1, 1)
    model = modeling.CausalLMLoss(lm)
    base, _ = model(ids, labels, reduction="row")
    adapters.inject(lm, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.5)                    # adapters that change the output
    tuned, _ = model(ids, labels, reduction="row")
    with torch.no_grad(), adapters.disabled(model):
        off, _ = model(ids, labels, reduction="row")
    assert not torch.allclose(tuned, base, atol=1e-3)
    assert torch.allclose(off, base, atol=1e-6)
    after, _ = model(ids, labels, reduction="row")
    assert torch.allclose(after, tuned) and all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


# --- the figures in the front ends --------------------------------------------------------------------

def test_step_and_eval_lines_and_tensorboard_carry_the_figures_only_for_preference_runs():
    from shardconsole import headless
    from shardconsole.runlog import protocol as P
    from shardconsole.runlog.runstate import RunState
    from shardconsole.runlog.tbevents import scalars
    dpo = P.Step(run="r", step=3, steps=8, loss=0.61, reward_chosen=0.25, reward_rejected=-0.5, reward_margin=0.75,
                 pref_accuracy=0.875)
    sft = P.Step(run="r", step=3, steps=8, loss=2.5)
    lines = []
    for step in (dpo, sft):
        state = RunState()
        state.apply(step)
        lines.append(headless.step_line(state))
    assert "acc 87.5% margin +0.750 (chosen +0.250, rejected -0.500)" in lines[0] and "acc" not in lines[1]
    ev = P.Eval(run="r", step=8, loss=0.5, pairs=16, reward_chosen=0.1, reward_rejected=-0.2, reward_margin=0.3,
                pref_accuracy=1.0)
    assert headless.eval_line(ev) == ("eval step 8: loss 0.5000 acc 100.0% margin +0.300 (chosen +0.100, "
                                      "rejected -0.200) over 16 pairs (0.0 s)")
    assert dict(scalars(dpo))["rewards/train_accuracy_pct"] == 87.5
    assert dict(scalars(ev))["rewards/eval_margin"] == pytest.approx(0.3)
    assert not any(tag.startswith("rewards/") for tag, _ in scalars(sft))


def test_data_preview_shows_a_pair_with_its_loss_masks(tmp_path):
    from hf_fixtures import make_hf_model
    from shardconsole.cli.data import format_preview
    from shardconsole.settings.models import resolve
    from shardconsole.tryout.preview import preview
    model = make_hf_model(tmp_path / "model", chat_template=True)
    recs = [{"prompt": [{"role": "user", "content": "how is it?"}], "chosen": [{"role": "assistant", "content": "good"}],
             "rejected": [{"role": "assistant", "content": "bad, really"}]}]
    data = write_jsonl(tmp_path / "p.jsonl", recs)
    cfg = settings.resolve("tiny-cpu", [f"model.name={model}", f"data.path={data}", "train.objective=orpo"]).cfg
    pv = preview(cfg, resolve(str(model)), 1)
    chosen, rejected = pv.records
    assert (pv.format, chosen.row, rejected.row) == ("preference", "chosen", "rejected")
    # the same prompt, not under loss, then the answer (its end of turn and the EOS) under loss
    assert [p.loss for p in chosen.pieces] == [False, True] and chosen.pieces[0].text == rejected.pieces[0].text
    assert chosen.pieces[0].text.endswith("<|im_start|>assistant\n")
    assert chosen.pieces[1].text == "good<|im_end|>\n<|endoftext|>"
    assert rejected.loss_tokens == rejected.pieces[1].tokens and "bad, really" in rejected.pieces[1].text
    text = format_preview(pv, color=False)
    assert "── record 1 chosen" in text and "── record 1 rejected" in text and "⟦good<|im_end|>" in text


# --- the planner and tune ------------------------------------------------------------------------------

def test_planner_counts_two_rows_a_pair_and_says_what_the_reference_costs(tmp_path):
    from shardconsole import plan as PL
    from shardconsole.plan.activation_memory import activations
    from shardconsole.plan.search import NUMERICS
    from shardconsole.plan.shapes import Shapes
    from shardconsole.plan.speed.book import signature
    from shardconsole.settings.models import resolve
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    # the chunked loss throughout: DPO always reads chunked per-row log-probs, so SFT of the same rows is
    # compared on it (memory.loss's default, auto, would give SFT on a GPU the fused loss)
    base = [f"data.path={data}", "train.micro_batch=2", "parallel.device=cuda", "model.name=1b", "memory.loss=chunked"]
    sft = settings.resolve("tiny-cpu", base).cfg
    dpo = settings.resolve("tiny-cpu", [*base, "train.objective=dpo"]).cfg
    rows4 = settings.resolve("tiny-cpu", [f"data.path={data}", "train.micro_batch=4", "parallel.device=cuda",
                                          "model.name=1b", "memory.loss=chunked"]).cfg
    s = Shapes.of(resolve("1b"))
    assert activations(dpo, s).saved_all == activations(rows4, s).saved_all > activations(sft, s).saved_all
    hw = PL.Hardware(gpus=1, gpu_memory_bytes=80 * 2**30, host_memory_bytes=256 * 2**30, gpu_name="H100")
    est, est_sft = PL.estimate(dpo, resolve("1b"), hw), PL.estimate(sft, resolve("1b"), hw)
    assert est.gpu_peak_bytes > est_sft.gpu_peak_bytes
    assert "reference pass" in " ".join(est.notes) and "16 bytes a pair" in " ".join(est.notes)
    lora = settings.resolve("tiny-cpu", [*base, "train.objective=dpo", "train.method=lora"]).cfg
    from shardconsole.plan.estimator import preference_notes
    assert "reference pass" in " ".join(preference_notes(dpo))
    assert "adapters off" in " ".join(preference_notes(lora)) and preference_notes(sft) == []
    # the speed book keeps DPO apart from SFT; tune never changes the objective (it is not a lever)
    assert signature(dpo)["objective"] == "dpo" and "objective" not in signature(sft)
    assert rows4.tokens_per_step == dpo.tokens_per_step
    assert not any(k.startswith("train.objective") for k in NUMERICS)    # never a lever --vary could name


# --- the objective in one process: the reference pass, its cache, the loss, the eval --------------------

def _rank(tmp_path, cfg, spec, events):
    """What the objective reads of a backends.rank.common.Rank, for one process without a process group."""
    from types import SimpleNamespace

    from shardconsole.backends.rank.common import DataState
    return SimpleNamespace(cfg=cfg, spec=spec, device=torch.device("cpu"), rank=0, world=1, data_state=DataState(),
                           log=lambda line: None, phase=lambda name: None,
                           event=lambda name, detail: events.append((name, detail)))


def test_full_dpo_reference_pass_is_cached_and_read_back(tmp_path, monkeypatch):
    from hf_fixtures import make_hf_model
    from transformers import AutoModelForCausalLM
    from shardconsole.backends.data import preference as D
    from shardconsole.backends.model import modeling
    from shardconsole.backends.objective import preference as O
    from shardconsole.settings.models import resolve
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = make_hf_model(tmp_path / "model", chat_template=True)
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    cfg = settings.resolve("tiny-cpu", [f"model.name={model_dir}", f"data.path={data}", "train.objective=dpo",
                                        "data.seq_len=32", "data.eval_fraction=0.25", "train.micro_batch=3"]).cfg
    spec = resolve(str(model_dir))
    model = modeling.CausalLMLoss(AutoModelForCausalLM.from_pretrained(model_dir)).train()
    events: list = []
    obj = O.make(_rank(tmp_path, cfg, spec, events))
    obj.prepare(model)
    assert "computed with the starting weights" in events[-1][1]
    entry = D.pair_entry(obj.r)
    # the table is the starting model's summed answer log-probs, pair by pair, for both splits
    for split_name, split in (("train", entry.train), ("eval", entry.eval)):
        batch = D.to_batch(split, list(range(split.n)), cfg.data.seq_len)
        with torch.no_grad():
            sums, _ = model(batch.inputs, batch.labels, reduction="row")
        assert torch.allclose(obj.table.tables[split_name].float(),
                              torch.stack([sums[:split.n], sums[split.n:]], 1), atol=1e-5)
    # a second run reads it back (the info line says so) instead of a pass
    events.clear()
    again = O.make(_rank(tmp_path, cfg, spec, events))
    again.prepare(model)
    assert "read from the cache" in events[-1][1]
    # at the starting weights every reward is 0: the loss is log 2, the margin 0, no pair ordered right
    batch = D.PairSource(entry.train, cfg.data.seq_len, cfg.train.seed, 0, 1, "x").batch(3)
    loss = again.micro_loss(model, batch)
    assert float(loss) == pytest.approx(np.log(2), abs=1e-5)
    loss.backward()                    # it trains: gradients reach the weights
    assert model.lm.lm_head.weight.grad is not None
    f = again.figures()
    assert f["reward_margin"] == pytest.approx(0, abs=1e-5) and f["pref_accuracy"] == 0 and again.figures() == {}
    # eval: every held-out pair once, the padding (an empty pair) weighted out
    ev = again.evaluate(model, D.EvalPairs(entry.eval, cfg.data.seq_len, 0, 1), 2, torch.device("cpu"))
    assert ev["pairs"] == entry.eval.n == 3 and ev["loss"] == pytest.approx(np.log(2), abs=1e-5)


def test_orpo_needs_no_reference_and_its_loss_is_the_nll_minus_the_odds_term(tmp_path, monkeypatch):
    from hf_fixtures import make_hf_model
    from transformers import AutoModelForCausalLM
    from shardconsole.backends.data import preference as D
    from shardconsole.backends.model import modeling
    from shardconsole.backends.objective import preference as O
    from shardconsole.settings.models import resolve
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = make_hf_model(tmp_path / "model")
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    cfg = settings.resolve("tiny-cpu", [f"model.name={model_dir}", f"data.path={data}", "train.objective=orpo",
                                        "data.seq_len=32", "preference.orpo_lambda=0.5"]).cfg
    model = modeling.CausalLMLoss(AutoModelForCausalLM.from_pretrained(model_dir))
    events: list = []
    obj = O.make(_rank(tmp_path, cfg, resolve(str(model_dir)), events))
    obj.prepare(model)
    assert events == [] and obj.table is None
    entry = D.pair_entry(obj.r)
    batch = D.to_batch(entry.train, [0, 1], cfg.data.seq_len)
    loss = obj.micro_loss(model, batch)
    with torch.no_grad():
        sums, counts = model(batch.inputs, batch.labels, reduction="row")
        nll = float(model(batch.inputs[:2], batch.labels[:2]))        # the chosen rows' mean token loss
    nll2, ratio, _, _ = O.orpo_losses(sums[:2], sums[2:], counts[:2], counts[2:], 0.5)
    assert float(nll2) == pytest.approx(nll, abs=1e-5)
    assert float(loss) == pytest.approx(nll - float(ratio.mean()), abs=1e-5)


@pytest.mark.parametrize("kind", ["parquet", "saved"])
def test_bad_records_of_parquet_and_saved_folders_are_named_before_launch(tmp_path, kind):
    import datasets
    recs = PAIRS[:5] + [{"prompt": "p", "chosen": "fine", "rejected": ""}] + PAIRS[5:]
    ds = datasets.Dataset.from_list(recs)
    path = tmp_path / ("p.parquet" if kind == "parquet" else "saved")
    ds.to_parquet(str(path)) if kind == "parquet" else ds.save_to_disk(str(path))
    with pytest.raises(C.ConfigError) as e:
        check_data(dpo_cfg(path))
    assert f"{path}: record 6: field 'rejected': empty answer" in str(e.value)
    good = tmp_path / ("good.parquet" if kind == "parquet" else "good")
    datasets.Dataset.from_list(PAIRS).to_parquet(str(good)) if kind == "parquet" else \
        datasets.Dataset.from_list(PAIRS).save_to_disk(str(good))
    check_data(dpo_cfg(good))


def test_compare_shows_the_held_out_preference_accuracy_of_preference_runs(tmp_path):
    from shardconsole.history import compare
    from shardconsole.history.index import RunSummary
    runs = [RunSummary(path=tmp_path / "sft", status="finished", eval_loss=2.0),
            RunSummary(path=tmp_path / "dpo", status="finished", eval_loss=0.5, eval_pref_accuracy=0.875)]
    line = next(x for x in compare.compare_text(runs) if "eval pref accuracy" in x)
    assert line.split()[-2:] == ["-", "87.5%"]
    assert not any("eval pref accuracy" in x for x in compare.compare_text(runs[:1]))
