"""GGUF export of sentencepiece tokenizers (issue 66): Gemma 3 and Phi-3 folders that carry a real
tokenizer.model (trained here with sentencepiece's own trainer), or only a tokenizer.json of
sentencepiece's kind (as transformers 5 saves one), read back with llama.cpp's reader (gguf.GGUFReader);
and the pre-tokenizer names of released byte-level BPE tokenizers (Mistral's Tekken, SmolLM's, o200k).

The expected side is written out here from convert_hf_to_gguf.py's rules (TextModel._create_vocab_sentencepiece,
Phi3MiniModel.set_vocab, _set_vocab_llama_hf) over the sentencepiece model's own pieces, scores and kinds
(sentencepiece's processor) or the transformers tokenizer's own id order; the regexes are the ones
llama.cpp's llama-vocab.cpp quotes as "original regex from tokenizer.json", copied as its C strings.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import gguf
import pytest

from tests.family_fixtures import make_family_model

T = gguf.TokenType
VOCAB = 384              # config.json's vocab_size (family_fixtures' tokenizer): 84 rows past the 300 pieces
PIECES = 300


def train_spm(gemma: bool) -> bytes:
    """A real sentencepiece BPE model with byte fallback: Gemma's special ids (<pad> 0, <eos> 1, <bos> 2,
    <unk> 3, two turn markers) or Llama's / Phi-3's (<unk> 0, <s> 1, </s> 2)."""
    import sentencepiece as spm
    words = "the quick brown fox jumps over lazy dog model token piece gemma phi export file layer".split()
    rnd = random.Random(0)
    lines = [" ".join(rnd.choice(words) for _ in range(8)) for _ in range(400)]
    ids = (dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
                user_defined_symbols=["<start_of_turn>", "<end_of_turn>"]) if gemma else
           dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1))
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=PIECES,
                                   model_type="bpe", byte_fallback=True, minloglevel=2, **ids)
    return buf.getvalue()


def processor(model: bytes):
    import sentencepiece as spm
    return spm.SentencePieceProcessor(model_proto=model)


def spm_folder(root: Path, family: str, model: bytes, tokenizer_config: dict, ids: dict,
               added_tokens: dict | None = None) -> Path:
    """A `family` model folder whose tokenizer is tokenizer.model and tokenizer_config.json (no tokenizer.json)."""
    folder = make_family_model(root, family)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    (folder / "tokenizer.model").write_bytes(model)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if added_tokens is not None:
        (folder / "added_tokens.json").write_text(json.dumps(added_tokens))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **ids}))
    assert config["vocab_size"] == VOCAB
    return folder


def export(folder: Path, out: Path) -> gguf.GGUFReader:
    from shardconsole.cli.trained_model.export_model import cmd_export_model
    assert cmd_export_model([str(folder), "-o", str(out), "--gguf", "f16"]) == 0
    return gguf.GGUFReader(out / "model-f16.gguf")


def field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def embedding_rows(reader) -> int:
    t = {t.name: t for t in reader.tensors}["token_embd.weight"]
    return int(t.n_elements) // 64          # hidden 64


def _spec(content: str, special: bool) -> dict:
    return {"content": content, "special": special, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False}


def test_gemma3_tokenizer_model_as_the_converter_writes_it(tmp_path):
    """_create_vocab_sentencepiece: pieces, scores and kinds in id order, "[PAD<id>]" up to vocab_size,
    tokenizer_config's added tokens laid over (special or looking special: control; a user token's
    "\u2581" a space); model "llama", pre "default", no space prefix (Gemma3Model.set_vocab); the
    embedding keeps vocab_size rows, the token list's length."""
    model = train_spm(gemma=True)
    sp = processor(model)
    decoder = {str(i): _spec(sp.IdToPiece(i), True) for i in range(6)}
    decoder.update({"300": _spec("<unused0>", False), "301": _spec("\u2581hello\u2581", False)})
    cfg = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
           "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder,
           "chat_template": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.content }}<end_of_turn>"
                            "{% endfor %}"}
    folder = spm_folder(tmp_path / "g", "gemma3", model, cfg, {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0})
    reader = export(folder, tmp_path / "out")

    tokens = [sp.IdToPiece(i) for i in range(PIECES)] + ["<unused0>", " hello "] + \
        [f"[PAD{i}]" for i in range(302, VOCAB)]
    scores = [-1000.0] * 6 + [sp.GetScore(i) for i in range(6, PIECES)] + [-1000.0] * 2 + [-10000.0] * (VOCAB - 302)
    types = [T.CONTROL] * 6 + [T.BYTE if sp.IsByte(i) else T.NORMAL for i in range(6, PIECES)] + \
        [T.CONTROL, T.USER_DEFINED] + [T.UNUSED] * (VOCAB - 302)
    assert field(reader, "tokenizer.ggml.model") == "llama" and field(reader, "tokenizer.ggml.pre") == "default"
    assert field(reader, "tokenizer.ggml.tokens") == tokens
    assert field(reader, "tokenizer.ggml.scores") == pytest.approx(scores)
    assert field(reader, "tokenizer.ggml.token_type") == [int(t) for t in types]
    assert sum(t == T.BYTE for t in types) == 256                   # byte fallback's pieces, as BYTE
    assert (field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id"),
            field(reader, "tokenizer.ggml.padding_token_id")) == (2, 1, 0)
    assert field(reader, "tokenizer.ggml.add_bos_token") is True
    assert field(reader, "tokenizer.ggml.add_eos_token") is False
    assert field(reader, "tokenizer.ggml.add_space_prefix") is False
    assert field(reader, "tokenizer.chat_template") == cfg["chat_template"]
    assert embedding_rows(reader) == VOCAB == len(tokens)


def test_phi3_tokenizer_model_follows_phi3s_own_recipe(tmp_path):
    """Phi3MiniModel.set_vocab: added_tokens.json's tokens user-defined, then tokenizer_config's laid over
    with "special" alone deciding (a <|...|> token marked not special stays user-defined, "\u2581" kept);
    no add_space_prefix key."""
    model = train_spm(gemma=False)
    sp = processor(model)
    added = {"<|endoftext|>": 300, "<|assistant|>": 301, "<|placeholder1|>": 302, "<|end|>": 303, "\u2581hi": 304}
    decoder = {"0": _spec("<unk>", True), "1": _spec("<s>", True), "2": _spec("</s>", True),
               "300": _spec("<|endoftext|>", True), "301": _spec("<|assistant|>", True),
               "302": _spec("<|placeholder1|>", False), "303": _spec("<|end|>", True), "304": _spec("\u2581hi", False)}
    cfg = {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>", "add_bos_token": False,
           "add_eos_token": False, "added_tokens_decoder": decoder, "chat_template": "{{ messages }}<|end|>"}
    folder = spm_folder(tmp_path / "p", "phi3", model, cfg, {"bos_token_id": 1, "eos_token_id": 300}, added)
    reader = export(folder, tmp_path / "out")

    tokens = [sp.IdToPiece(i) for i in range(PIECES)] + list(added) + [f"[PAD{i}]" for i in range(305, VOCAB)]
    scores = [-1000.0] * 3 + [sp.GetScore(i) for i in range(3, PIECES)] + [-1000.0] * 5 + [-10000.0] * (VOCAB - 305)
    types = [T.CONTROL] * 3 + [T.BYTE if sp.IsByte(i) else T.NORMAL for i in range(3, PIECES)] + \
        [T.CONTROL, T.CONTROL, T.USER_DEFINED, T.CONTROL, T.USER_DEFINED] + [T.UNUSED] * (VOCAB - 305)
    assert field(reader, "general.architecture") == "phi3"
    assert field(reader, "tokenizer.ggml.model") == "llama" and field(reader, "tokenizer.ggml.pre") == "default"
    assert field(reader, "tokenizer.ggml.tokens") == tokens
    assert field(reader, "tokenizer.ggml.scores") == pytest.approx(scores)
    assert field(reader, "tokenizer.ggml.token_type") == [int(t) for t in types]
    assert (field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id")) == (1, 300)
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert field(reader, "tokenizer.ggml.add_space_prefix") is None
    assert embedding_rows(reader) == VOCAB
    assert 'PARAMETER stop "<|end|>"' in (tmp_path / "out" / "Modelfile").read_text()


def hf_spm_folder(root: Path, family: str, model: bytes, specials: dict) -> Path:
    """A `family` folder whose tokenizer is only a tokenizer.json of sentencepiece's kind: the model
    loaded by transformers from tokenizer.model and saved again (transformers 5 writes no tokenizer.model)."""
    from transformers import AutoTokenizer
    src = root / "spm"
    src.mkdir(parents=True)
    (src / "tokenizer.model").write_bytes(model)
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", **specials}))
    folder = make_family_model(root / family, family)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)
    assert not (folder / "tokenizer.model").exists()
    return folder


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_sentencepiece_tokenizer_json_alone_goes_through_llama_hf_vocab(family, tmp_path):
    """_set_vocab_llama_hf: the tokenizer's ids in order, score -1000, <0xNN> BYTE, specials CONTROL;
    Gemma 3's embedding cut to the tokenizer's rows, Phi-3's kept with "[PAD<i>]" filling the list."""
    from transformers import AutoTokenizer
    gemma = family == "gemma3"
    specials = ({"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"} if gemma
                else {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    folder = hf_spm_folder(tmp_path, family, train_spm(gemma), specials)
    tok = AutoTokenizer.from_pretrained(folder)
    reader = export(folder, tmp_path / "out")
    pieces = tok.convert_ids_to_tokens(list(range(PIECES)))
    special = set(tok.all_special_ids)
    types = [T.CONTROL if i in special else T.BYTE if p.startswith("<0x") and len(p) == 6 else T.NORMAL
             for i, p in enumerate(pieces)]
    pad = [] if gemma else [f"[PAD{i}]" for i in range(1, VOCAB - PIECES + 1)]
    assert field(reader, "tokenizer.ggml.model") == "llama" and field(reader, "tokenizer.ggml.pre") == "default"
    assert field(reader, "tokenizer.ggml.tokens") == pieces + pad
    assert field(reader, "tokenizer.ggml.scores") == pytest.approx([-1000.0] * (PIECES + len(pad)))
    assert field(reader, "tokenizer.ggml.token_type") == [int(t) for t in types] + [int(T.UNUSED)] * len(pad)
    assert field(reader, "tokenizer.ggml.eos_token_id") == tok.eos_token_id
    assert field(reader, "tokenizer.ggml.add_space_prefix") is (False if gemma else None)
    assert embedding_rows(reader) == (PIECES if gemma else VOCAB)


# llama-vocab.cpp's C strings of the "original regex from tokenizer.json" (json.loads undoes C's escapes)
TEKKEN = json.loads('"' + r"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
                    r"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}|"
                    r" ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+" + '"')
GPT4O = json.loads('"' + r"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
                   r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
                   r"[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
                   r"[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+" + '"')
SEED_CODER = json.loads('"' + r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}"
                        r"\\p{N}\r\n]+|\\s*[\r\n]+|\\s+(?!\\S)|\\s+" + '"')


def _with_pre(folder: Path, pre) -> Path:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.pre_tokenizer = pre
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_tekken_pre_tokenizer_is_named_in_the_file(tmp_path):
    """Mistral Nemo / Small 24B's tokenizer.json (Tekken's split, then ByteLevel without its regex) exports
    with tokenizer.ggml.pre "tekken", the name llama.cpp splits that way."""
    from tokenizers import Regex, pre_tokenizers
    folder = _with_pre(make_family_model(tmp_path / "m", "mistral"), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TEKKEN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    reader = export(folder, tmp_path / "out")
    assert field(reader, "tokenizer.ggml.model") == "gpt2" and field(reader, "tokenizer.ggml.pre") == "tekken"


@pytest.mark.parametrize("regex, name", [(TEKKEN, "tekken"), (GPT4O, "gpt-4o"), (SEED_CODER, "seed-coder")],
                         ids=["tekken", "gpt-4o", "seed-coder"])
def test_released_split_regexes_get_llama_cpps_names(regex, name):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from shardconsole.settings.gguf_kinds import pre_tokenizer_name
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert pre_tokenizer_name(json.loads(tok.to_str()), Path("t")) == name


def test_smollm_digits_then_byte_level_is_smollm():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardconsole.settings.gguf_kinds import pre_tokenizer_name
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    assert pre_tokenizer_name(json.loads(tok.to_str()), Path("t")) == "smollm"


def test_a_sentencepiece_tokenizer_on_qwen_is_refused_in_one_line(tmp_path):
    """Qwen's converter writes byte-level BPE only: a tokenizer.model folder is one line, no output."""
    from tests.conftest import shardconsole
    folder = spm_folder(tmp_path / "q", "qwen2", train_spm(gemma=False), {"eos_token": "</s>"}, {})
    res = shardconsole("export-model", str(folder), "-o", str(tmp_path / "out"), "--gguf", "f16")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "tokenizer.model" in lines[0] and "gemma3" in lines[0] and not (tmp_path / "out").exists()


def test_preflight_accepts_sentencepiece_families_and_refuses_others(tmp_path):
    """train.export_gguf's check before launch (gguf_kinds.problem) says the same as the export."""
    from shardconsole.settings.gguf_kinds import problem
    model = train_spm(gemma=False)
    for family, ok in (("phi3", True), ("mistral", True), ("qwen3", False)):
        folder = spm_folder(tmp_path / family, family, model, {"eos_token": "</s>"}, {})
        said = problem(json.loads((folder / "config.json").read_text()), folder, family)
        assert (said is None) == ok, (family, said)
