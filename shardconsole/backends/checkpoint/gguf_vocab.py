"""The tokenizer and chat template of a GGUF file, as llama.cpp's convert_hf_to_gguf.py writes them for a
byte-level BPE tokenizer (tokenizer.json: Llama 3, Qwen 2 / 3, Mistral's Tekken, and the folders our tests
make): tokenizer.ggml.model "gpt2", the token list in id order with each token's type, the merges, the
special ids and add-BOS/EOS flags and the chat template (gguf's own SpecialVocab reads those from
tokenizer.json / tokenizer_config.json / chat_template.jinja), and tokenizer.ggml.pre, the name of the
pre-tokenizer llama.cpp must split text with before the merges.

The converter names the pre-tokenizer by hashing the token ids of a test string and looking the hash up
in a list of released tokenizers; a fine-tuned or home-made tokenizer matches none. Here the name comes
from what the hash stands for, the pre-tokenizer tokenizer.json declares: GPT-2's byte-level split, or
one of the split regexes llama.cpp implements under a name. Anything else is refused: a GGUF that splits
text otherwise than the model was trained on answers worse, silently.

A sentencepiece tokenizer (tokenizer.model, or a tokenizer.json of sentencepiece's kind: Gemma 3's, Phi-3's,
Mistral 7B's) is gguf_spm.py's; which kind a folder has is settings/gguf_kinds.vocab_kind's.
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from shardconsole.backends.checkpoint import gguf_spm
from shardconsole.settings.gguf_kinds import GgufKindError, pre_tokenizer_name, tokenizer_json, vocab_kind

@dataclass(frozen=True)
class Tokenizer:
    """The folder's tokenizer as the GGUF will hold it: its kind (gguf_kinds.vocab_kind), the token list
    for the sentencepiece kinds, and the rows Gemma 3's embedding is cut to (None: not cut)."""
    folder: Path
    kind: str
    vocab: gguf_spm.Vocab | None
    gemma_rows: int | None


def read_tokenizer(folder: Path, config: dict, arch: str) -> Tokenizer:
    """Before anything is written: the kind is refused here, and Gemma 3's embedding rows follow the
    token list (Gemma3Model.modify_tensors: the sentencepiece list, else tokenizer.json's tokens)."""
    kind = vocab_kind(folder, arch)
    vocab = None
    if kind == "spm":
        vocab = gguf_spm.sentencepiece_vocab(folder, config["vocab_size"], phi3=arch == "PHI3")
    elif kind == "llama_hf":
        # Gemma 3's embedding is cut to the tokenizer's rows; the others keep theirs and the list is padded to it
        vocab = gguf_spm.llama_hf_vocab(folder, 0 if arch == "GEMMA3" else config["vocab_size"])
    rows = None
    if arch == "GEMMA3":
        if vocab is not None:
            rows = len(vocab[0])
        else:
            tok = tokenizer_json(folder)
            rows = len(tok["model"]["vocab"]) + len(tok.get("added_tokens") or [])
    return Tokenizer(folder, kind, vocab, rows)


def token_list(folder: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id below vocab_size: its token text and gguf.TokenType, as the converter's get_vocab_base."""
    import gguf
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise GgufKindError(f"{folder}: the tokenizer has id {max(vocab.values())}, past config.json's vocab_size "
                         f"{vocab_size}")
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")          # rows past the tokenizer (padded embeddings)
            types.append(gguf.TokenType.UNUSED)
            continue
        text = reverse[i]
        if text in added:
            if not decoder[i].normalized:
                # llama.cpp takes control and user tokens as already normalized
                text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
            if decoder[i].special or gguf_spm.looks_special(text):
                types.append(gguf.TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(text)
    return tokens, types


def add_vocab(writer: Any, tokenizer: Tokenizer, config: dict, arch: str) -> None:
    """tokenizer.ggml.* and tokenizer.chat_template on `writer`: the converter's _set_vocab_gpt2, or for
    sentencepiece's kinds _set_vocab_sentencepiece / Phi-3's own / _set_vocab_llama_hf (gguf_spm.py)."""
    import gguf
    folder = tokenizer.folder
    if tokenizer.vocab is not None:
        gguf_spm.add_llama_vocab(writer, folder, tokenizer.vocab, gemma=arch == "GEMMA3")
        return
    pre = pre_tokenizer_name(tokenizer_json(folder), folder)
    tokens, types = token_list(folder, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def modelfile_text(gguf_name: str, folder: Path) -> str:
    """Ollama's Modelfile beside the GGUF: FROM the file, and the tokenizer's end-of-turn tokens as stops.
    Its TEMPLATE is left out on purpose: Ollama takes the chat template from the file's
    tokenizer.chat_template, and a Go template hand-made from the Jinja one could say otherwise."""
    stops = []
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    eos = cfg.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos:
        stops.append(eos)
    template = _chat_template(folder, cfg)
    for marker in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if template and marker in template and marker not in stops:
            stops.append(marker)
    lines = [f"FROM ./{gguf_name}"]
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in stops]
    return "\n".join(lines) + "\n"


def _chat_template(folder: Path, cfg: dict) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    tpl = cfg.get("chat_template")
    return tpl if isinstance(tpl, str) else None
