"""What a GGUF export can express, standard library only: the families (by the Hugging Face architecture,
named as llama.cpp's convert_hf_to_gguf.py registers them) and the tokenizers (byte-level BPE, with a
pre-tokenizer llama.cpp names). The converter (backends/checkpoint/gguf_file.py, gguf_vocab.py) refuses
with these lines, and the run's preflight says them before launch for train.export_gguf.
"""

from __future__ import annotations

import json
from pathlib import Path

GGUF_TYPES = ("f16", "bf16", "q8_0")

# Hugging Face architecture -> llama.cpp's architecture (gguf.MODEL_ARCH member); Mistral runs as llama.
ARCHITECTURES = {
    "LlamaForCausalLM": "LLAMA",
    "MistralForCausalLM": "LLAMA",
    "Qwen2ForCausalLM": "QWEN2",
    "Qwen3ForCausalLM": "QWEN3",
    "Gemma3ForCausalLM": "GEMMA3",
    "Phi3ForCausalLM": "PHI3",
}

# The split regexes of tokenizer.json's Split pre-tokenizer (ByteLevel after it, its regex off) that
# llama.cpp implements, by the name tokenizer.ggml.pre gives them (its llama-vocab.cpp).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
KNOWN_SPLITS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}


class GgufKindError(ValueError):
    """One line: the model or its tokenizer is of a kind the GGUF export does not write."""


def arch_of(config: dict, where: Path | str) -> str:
    """llama.cpp's architecture for config.json's, or GgufKindError."""
    archs = config.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    named = ", ".join(archs) or f"model_type {config.get('model_type')!r}"
    raise GgufKindError(f"{where}: {named} has no GGUF export here (it covers {', '.join(sorted(ARCHITECTURES))})")


def tokenizer_json(folder: Path) -> dict:
    path = folder / "tokenizer.json"
    if not path.is_file():
        what = "a sentencepiece tokenizer.model" if (folder / "tokenizer.model").is_file() else "no tokenizer.json"
        raise GgufKindError(f"{folder}: {what}: the GGUF export writes byte-level BPE tokenizers (tokenizer.json) "
                            f"only; a GGUF without its tokenizer is not one llama.cpp or Ollama can chat with")
    return json.loads(path.read_text())


def _byte_level(pre: dict) -> bool:
    return pre.get("type") == "ByteLevel" or any(p.get("type") == "ByteLevel" for p in pre.get("pretokenizers") or [])


def pre_tokenizer_name(tok: dict, where: Path) -> str:
    """tokenizer.ggml.pre for tokenizer.json's pre-tokenizer: GPT-2's byte-level split, or a split regex
    llama.cpp implements; anything else is refused (a GGUF splitting text otherwise than the model
    learned answers worse, silently)."""
    pre = tok.get("pre_tokenizer") or {}
    kind = (tok.get("model") or {}).get("type")
    if kind != "BPE" or not _byte_level(pre):
        raise GgufKindError(f"{where / 'tokenizer.json'}: a {kind} tokenizer without a byte-level pre-tokenizer "
                            f"(sentencepiece's kind): the GGUF export writes byte-level BPE tokenizers only")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"          # ByteLevel's own split is GPT-2's regex
    parts = pre.get("pretokenizers") or []
    splits = [p for p in parts if p.get("type") == "Split"]
    level = [p for p in parts if p.get("type") == "ByteLevel"]
    if len(parts) == 2 and len(splits) == 1 and level and not level[0].get("use_regex", True):
        regex = (splits[0].get("pattern") or {}).get("Regex")
        if regex in KNOWN_SPLITS:
            return KNOWN_SPLITS[regex]
    raise GgufKindError(f"{where / 'tokenizer.json'}: its pre-tokenizer is none llama.cpp names (the export knows "
                        f"GPT-2's byte-level split and the {', '.join(sorted(KNOWN_SPLITS.values()))} regexes); "
                        f"a GGUF splitting text otherwise than the model learned would answer worse")


def problem(config: dict, folder: Path | None, name: str) -> str | None:
    """Why a model (its config.json, its folder: None for a catalog size) has no GGUF export; None: it has."""
    if folder is None:
        return f"{name}: a catalog model has no tokenizer, and a GGUF needs one (train from a model folder)"
    try:
        arch_of(config, f"{name}: config.json")
        pre_tokenizer_name(tokenizer_json(folder), folder)
    except GgufKindError as e:
        return str(e)
    return None
