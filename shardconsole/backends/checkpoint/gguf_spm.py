"""The sentencepiece tokenizers of a GGUF file (tokenizer.ggml.model "llama"), as llama.cpp's
convert_hf_to_gguf.py writes them: Gemma 3's, Phi-3's and Mistral 7B's / Llama 2's.

- a folder with tokenizer.model: the sentencepiece model read with the sentencepiece package, each piece's
  text, score and type (unknown, control, unused, byte, normal) in id order, the ids past it up to
  config.json's vocab_size "[PAD<id>]" (unused, score -10000), then the added tokens laid over it
  (added_tokens.json, tokenizer_config.json's added_tokens_decoder: score -1000). Two recipes, as the
  converter has: the common one (TextModel._create_vocab_sentencepiece: Gemma 3, llama) marks an added
  token control when it is special or looks special and turns a user token's "\u2581" into a space;
  Phi-3's own (Phi3MiniModel.set_vocab) takes "special" alone and also reads tokenizer.json's added_tokens.
- a folder with only a tokenizer.json of sentencepiece's kind (BPE with byte fallback, the kind
  transformers 5 saves a fine-tuned Gemma / Phi-3 / Mistral 7B tokenizer as): gguf's LlamaHfVocab, the
  converter's _set_vocab_llama_hf (scores -1000, byte pieces BYTE, specials CONTROL), padded with
  "[PAD<i>]" to config.json's vocab_size as _create_vocab_sentencepiece pads, so the token list matches
  the embedding's rows (llama.cpp refuses a file where they differ).

The special ids, add-BOS/EOS flags and chat template come from gguf's own SpecialVocab in both cases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# convert_hf_to_gguf.py's SentencePieceTokenTypes, the values of gguf.TokenType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

Vocab = tuple[list[bytes], list[float], list[int]]


def looks_special(text: str) -> bool:
    """Added tokens marked not special that are control tokens all the same (the converter's
    does_token_look_special: command-r, deepseek-coder, Gemma's <unusedN>)."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _pieces(folder: Path, vocab_size: int) -> Vocab:
    from sentencepiece import SentencePieceProcessor
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(folder / "tokenizer.model"))
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores, types = [-10000.0] * vocab_size, [UNUSED] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):      # past vocab_size: no embedding row for it
        kind = (UNKNOWN if sp.IsUnknown(i) else CONTROL if sp.IsControl(i) else UNUSED if sp.IsUnused(i)
                else BYTE if sp.IsByte(i) else NORMAL)
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), kind
    for text, i in (_json(folder / "added_tokens.json") or {}).items():
        if i < vocab_size:
            tokens[i], scores[i], types[i] = text.encode("utf-8"), -1000.0, USER_DEFINED
    return tokens, scores, types


def _added(vocab: Vocab, entries: list[tuple[int, dict]], phi3: bool) -> None:
    tokens, scores, types = vocab
    for i, data in entries:
        if i >= len(tokens):
            continue
        text: str = data["content"]
        if data.get("special") or (not phi3 and looks_special(text)):
            types[i] = CONTROL
        else:
            types[i] = USER_DEFINED
            if not phi3:
                text = text.replace("\u2581", " ")      # llama.cpp takes user tokens as pre-normalized
        tokens[i], scores[i] = text.encode("utf-8"), -1000.0


def sentencepiece_vocab(folder: Path, vocab_size: int, phi3: bool) -> Vocab:
    """tokens, scores and types from tokenizer.model and the added tokens, in the converter's recipe for
    Phi-3 (phi3) or the common one."""
    vocab = _pieces(folder, vocab_size)
    decoder = (_json(folder / "tokenizer_config.json") or {}).get("added_tokens_decoder") or {}
    _added(vocab, [(int(i), d) for i, d in decoder.items()], phi3)
    if phi3:
        _added(vocab, [(int(d["id"]), d) for d in (_json(folder / "tokenizer.json") or {}).get("added_tokens") or []],
               phi3)
    return vocab


def llama_hf_vocab(folder: Path, vocab_size: int) -> Vocab:
    """gguf's LlamaHfVocab's tokens, padded to vocab_size (0: not padded)."""
    import gguf
    tokens, scores, types = [], [], []
    for text, score, kind in gguf.LlamaHfVocab(folder).all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(int(kind))
    for i in range(1, vocab_size - len(tokens) + 1):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(UNUSED)
    return tokens, scores, types


def add_llama_vocab(writer: Any, folder: Path, vocab: Vocab, gemma: bool) -> None:
    """tokenizer.ggml.* (model "llama", pre "default") and the chat template: _set_vocab_sentencepiece /
    _set_vocab_llama_hf; Gemma 3 also says its text gets no space prefix (Gemma3Model.set_vocab)."""
    import gguf
    tokens, scores, types = vocab
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    if gemma:
        writer.add_add_space_prefix(False)
