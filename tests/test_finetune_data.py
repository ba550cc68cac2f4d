"""Your data in: record formats and their loss masks with real tokenizers, the token cache, the checks
before launch, and one real 2-rank fine-tune on a chat file with a held-out eval loss."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import messages, of_kind, shardconsole
from hf_fixtures import make_hf_model
from shardconsole.settings import config as C
from shardconsole.backends.data import token_cache
from shardconsole.backends.data.corpus import DOC_START, LOSS, DataError
from shardconsole.settings.data.data_check import check_data

CHAT = [
    {"messages": [{"role": "user", "content": "what is two plus two?"},
                  {"role": "assistant", "content": "four."},
                  {"role": "user", "content": "and three plus three?"},
                  {"role": "assistant", "content": "six."}]},
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return {"chat": make_hf_model(base / "chat", chat_template=True), "base": make_hf_model(base / "base")}


@pytest.fixture(scope="module")
def tok(models):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(models["chat"])


def write_jsonl(path: Path, records) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def entry_for(path, model: Path | None, vocab: int = 384, **data):
    d = C.DataSettings(path=str(path), **data)
    has_tok = model is not None and (model / "tokenizer.json").is_file()
    return token_cache.open_entry(d, 1234, str(model) if model else None, has_tok, vocab, lambda s: None)


def under_loss(e, tok) -> tuple[str, list[int]]:
    ids, flags = np.asarray(e.train.ids), np.asarray(e.train.flags)
    return tok.decode(ids[(flags & LOSS) > 0].tolist()), ids.tolist()


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_two_turn_chat_loss_on_assistant_turns_only(tmp_path, models, tok):
    e = entry_for(write_jsonl(tmp_path / "chat.jsonl", CHAT), models["chat"])
    assert e.meta["format"] == "chat" and e.meta["template"] == "tokenizer's chat template"
    # Hand-written: the ChatML rendering, and what the model must learn to say (answers, end of turn, EOS).
    expect = ("<|im_start|>user\nwhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"
              "four.<|im_end|>\n<|im_start|>user\nand three plus three?<|im_end|>\n"
              "<|im_start|>assistant\nsix.<|im_end|>\n<|endoftext|>")
    text, ids = under_loss(e, tok)
    assert tok.decode(ids) == expect
    flags = np.asarray(e.train.flags)
    on = [i for i in range(len(ids)) if flags[i] & LOSS]
    a1 = ids_of(tok, "four.<|im_end|>\n")
    a2 = ids_of(tok, "six.<|im_end|>\n")
    assert [ids[i] for i in on] == a1 + a2 + [tok.eos_token_id]
    assert text == "four.<|im_end|>\nsix.<|im_end|>\n<|endoftext|>"
    assert flags[0] == DOC_START and e.train.records == 1


def test_base_tokenizer_without_template_uses_the_plain_one(tmp_path, models, tok):
    e = entry_for(write_jsonl(tmp_path / "chat.jsonl", CHAT), models["base"])
    assert e.meta["template"] == "shardconsole-plain"
    text, ids = under_loss(e, tok)
    assert tok.decode(ids) == ("User: what is two plus two?\n\nAssistant: four.\n\n"
                               "User: and three plus three?\n\nAssistant: six.\n\n<|endoftext|>")
    assert text == "four.\n\nsix.\n\n<|endoftext|>"


@pytest.mark.parametrize("records,fmt,answer", [
    ([{"prompt": "Question: name a colour. Answer:", "completion": " blue."}], "prompt_completion",
     " blue.<|endoftext|>"),
    ([{"instruction": "Name a colour.", "input": "", "output": "blue."}], "alpaca",
     "blue.<|im_end|>\n<|endoftext|>"),
    ([{"text": "The quick brown fox."}], "text", " quick brown fox.<|endoftext|>"),
])
def test_prompt_formats_put_only_the_answer_under_loss(tmp_path, models, tok, records, fmt, answer):
    e = entry_for(write_jsonl(tmp_path / "d.jsonl", records), models["chat"])
    assert e.meta["format"] == fmt
    text, _ = under_loss(e, tok)
    assert text == answer      # text: every token but the document's first, which nothing predicts


def test_txt_parquet_csv_and_a_saved_folder(tmp_path, models, tok):
    import datasets
    txt = tmp_path / "corpus.txt"
    txt.write_text("first document, one line.\n\nsecond document\nover two lines.\n")
    e = entry_for(txt, models["chat"])
    assert (e.meta["format"], e.train.records) == ("text", 2)
    assert tok.decode(np.asarray(e.train.ids).tolist()).count("<|endoftext|>") == 2
    rows = [{"prompt": f"Q{i}:", "completion": f" A{i}."} for i in range(3)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "d.csv"), index=False)
    datasets.Dataset.from_list(CHAT * 3).save_to_disk(str(tmp_path / "saved"))
    for name, fmt, n in (("d.parquet", "prompt_completion", 3), ("d.csv", "prompt_completion", 3),
                         ("saved", "chat", 3)):
        e = entry_for(tmp_path / name, models["chat"])
        assert (e.meta["format"], e.train.records) == (fmt, n), name


def test_cache_is_reused_and_keyed(tmp_path, models):
    f = write_jsonl(tmp_path / "chat.jsonl", CHAT * 5)
    first = entry_for(f, models["chat"])
    again = entry_for(f, models["chat"])
    assert first.built_here and not again.built_here and again.folder == first.folder
    assert isinstance(again.train.ids, np.memmap)
    assert entry_for(f, models["chat"], seq_len=64).built_here           # seq_len is part of the key
    write_jsonl(f, CHAT * 4)                                               # new content, same path
    assert entry_for(f, models["chat"]).built_here
    # A changed chat template (in a copy of the model folder) tokenizes again.
    other = tmp_path / "other-template"
    shutil.copytree(models["chat"], other)
    cfg_file = other / "tokenizer_config.json"
    tc = json.loads(cfg_file.read_text())
    if "chat_template" in tc:
        tc["chat_template"] = tc["chat_template"].replace("<|im_start|>", "<|im_start|> ")
        cfg_file.write_text(json.dumps(tc))
    else:
        jinja = other / "chat_template.jinja"
        jinja.write_text(jinja.read_text().replace("<|im_start|>", "<|im_start|> "))
    changed = entry_for(f, other)
    assert changed.built_here and changed.folder != first.folder
    # And the cache holds no half-built entry: only complete folders and lock files.
    root = token_cache.cache_root()
    assert all((p / "meta.json").is_file() for p in root.iterdir() if p.is_dir())


def test_a_bad_record_names_the_file_its_line_and_the_field(tmp_path, models):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps(CHAT[0]) + "\n\n" + json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n")
    with pytest.raises(DataError, match=r"chat\.jsonl:3: field 'messages'\[0\]\.content: expected a string"):
        entry_for(f, models["chat"])
    g = tmp_path / "broken.jsonl"
    g.write_text(json.dumps(CHAT[0]) + "\n" + '{"messages": [\n')
    with pytest.raises(DataError, match=r"broken\.jsonl:2: not valid JSON"):
        entry_for(g, models["chat"])
    h = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": None}])
    with pytest.raises(DataError, match=r"pc\.jsonl:2: field 'completion': missing"):
        entry_for(h, models["chat"])


def test_checks_before_launch(tmp_path, models):
    cfg = C.RunConfig()
    cfg.data.path = "tatsu-lab/alpaca"
    with pytest.raises(C.ConfigError, match=r"\[data\] path: 'tatsu-lab/alpaca' is not a local file.*"
                                            r"downloaded first.*save_to_disk"):
        check_data(cfg)
    cfg.data.path = str(tmp_path / "missing.jsonl")
    with pytest.raises(C.ConfigError, match=r"\[data\] path: .*missing.jsonl: no such file"):
        check_data(cfg)
    with pytest.raises(C.ConfigError, match=r"\[data\] source: is \"synthetic\" but \[data\] path is set"):
        C.build({"data": {"source": "synthetic", "path": "x.jsonl"}}, "p.toml", gpu_count=0)
    # A broken tokenizer.json: refused before launch and by the ranks, never read as bytes.
    broken = tmp_path / "broken-model"
    shutil.copytree(models["chat"], broken)
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    cfg.data.path = str(write_jsonl(tmp_path / "c.jsonl", CHAT))
    cfg.model.name = str(broken)
    with pytest.raises(C.ConfigError, match=r"\[model\] name: .*tokenizer.json: the tokenizer does not load"):
        check_data(cfg)
    with pytest.raises(DataError, match=r"tokenizer.json: the tokenizer does not load"):
        entry_for(cfg.data.path, broken)


def test_a_path_without_a_source_trains_on_the_file(tmp_path, models):
    from shardconsole.backends.data.batches import PackedWindows, _build
    f = write_jsonl(tmp_path / "chat.jsonl", CHAT * 20)
    cfg = C.build({"model": {"name": str(models["chat"])}, "data": {"path": str(f), "seq_len": 16}}, "p.toml",
                  gpu_count=0)
    assert cfg.data.source == "auto"
    src, _ = _build(cfg, 384, str(models["chat"]), True, 0, 2)
    assert isinstance(src, PackedWindows) and isinstance(src.ids, np.memmap)


def test_held_out_records_by_fraction_or_from_a_file(tmp_path, models, tok):
    rows = [{"prompt": f"Q{i}:", "completion": f" A{i}."} for i in range(8)]
    f = write_jsonl(tmp_path / "pc.jsonl", rows)
    e = entry_for(f, models["chat"], eval_fraction=0.25)
    assert (e.train.records, e.eval.records) == (6, 2)
    held = {t for t in tok.decode(np.asarray(e.eval.ids).tolist()).split("<|endoftext|>") if t}
    kept = {t for t in tok.decode(np.asarray(e.train.ids).tolist()).split("<|endoftext|>") if t}
    assert len(held) == 2 and not held & kept and held | kept == {f"Q{i}: A{i}." for i in range(8)}
    again = token_cache.open_entry(C.DataSettings(path=str(f), eval_fraction=0.25), 99, str(models["chat"]),
                                   True, 384, lambda s: None)
    assert again.built_here        # the split follows train.seed, so the seed is part of the key
    ev = write_jsonl(tmp_path / "eval.jsonl", CHAT)
    e = entry_for(f, models["chat"], eval_path=str(ev))
    assert (e.train.records, e.eval.records, e.meta["eval_format"]) == (8, 1, "chat")


def test_text_without_a_tokenizer_is_bytes(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("héllo\n\nworld\n")
    e = entry_for(f, None, vocab=512)
    assert e.meta["tokenizer"] == "bytes"
    assert np.asarray(e.train.ids).tolist() == list("héllo".encode()) + [0] + list(b"world") + [0]


@pytest.mark.slow
def test_two_rank_finetune_on_chat_with_eval(tmp_path, models, tok):
    """The README path: a model folder, a .jsonl of chats (data.path without a source) and a file of
    held-out chats: the data summary, and an eval loss over every held-out answer token on both ranks."""
    def chat(i):
        return {"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                             {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
    data = write_jsonl(tmp_path / "chats.jsonl", [chat(i) for i in range(60)])
    held = write_jsonl(tmp_path / "held.jsonl", [chat(i) for i in range(100, 107)])
    run_dir = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
                       "--set", f"model.name={models['chat']}", "--set", "data.source=auto",
                       "--set", f"data.path={data}", "--set", "data.seq_len=64", "--set", f"data.eval_path={held}",
                       "--set", "train.steps=4", "--set", "train.micro_batch=2", "--set", "train.log_every=1",
                       env={"SHARDCONSOLE_CACHE_DIR": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr[-3000:]
    msgs = messages(run_dir)
    [summary] = of_kind(msgs, "data")
    assert (summary.format, summary.records, summary.eval_records) == ("chat", 60, 7)
    assert summary.template == "tokenizer's chat template" and 0 < summary.loss_share < 0.6
    assert summary.epochs == pytest.approx(4 * 2 * 2 / summary.samples, abs=1e-3)
    evals = of_kind(msgs, "eval")
    # Under loss in each held-out chat: the answer, its end-of-turn marker and the EOS.
    expected = sum(len(ids_of(tok, f"{i} plus {i} is {2 * i}.<|im_end|>\n")) + 1 for i in range(100, 107))
    assert evals and evals[-1].step == 4 and evals[-1].tokens == expected and 0 < evals[-1].loss < 10
    # Tokenized once for both ranks: one rank wrote the cache.
    logs = [(run_dir / "logs" / f"rank{n}.log").read_text() for n in range(2)]
    assert sum("token cache written" in text for text in logs) == 1
