"""What a GGUF export can express, standard library only: the families (by the Hugging Face architecture,
named as llama.cpp's convert_hf_to_gguf.py registers them) and the tokenizers: byte-level BPE with a
pre-tokenizer llama.cpp names, and for the families whose converter class reads them (gemma3, phi3,
llama) sentencepiece's, from tokenizer.model or from a tokenizer.json of its kind. The converter
(backends/checkpoint/gguf_file.py, gguf_vocab.py, gguf_spm.py) refuses with these lines, and the run's
preflight says them before launch for train.export_gguf.
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

# Families whose converter class writes a sentencepiece vocabulary (tokenizer.ggml.model "llama"):
# Gemma3Model and Phi3MiniModel from tokenizer.model, LlamaModel from it or from a tokenizer.json of its kind.
SENTENCEPIECE_ARCHS = ("GEMMA3", "PHI3", "LLAMA")


def _r(c_literal: str) -> str:
    """A regex as llama.cpp's llama-vocab.cpp quotes tokenizer.json's ("original regex from
    tokenizer.json"): the C string's escapes are JSON's."""
    return json.loads(f'"{c_literal}"')


# The split regexes of tokenizer.json's Split pre-tokenizers (ByteLevel after them, its regex off) that
# llama.cpp implements, by the name tokenizer.ggml.pre gives them (its llama-vocab.cpp), for the
# released tokenizers of the families above that convert_hf_to_gguf.py knows by hash.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CASED = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
_UPPER = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
# Mistral's Tekken (Mistral Nemo, Mistral Small 3.x 24B, Devstral): GPT-4o's split without contractions
TEKKEN_SPLIT = f"{_CASED}|{_UPPER}" + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# o200k (Phi-4-mini, a Phi3ForCausalLM): llama.cpp's "gpt-4o"
GPT4O_SPLIT = (f"{_CASED}{_CONTRACTIONS}|{_UPPER}{_CONTRACTIONS}"
               + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# ByteDance Seed-Coder (a LlamaForCausalLM)
SEED_CODER_SPLIT = _r(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}"
                      r"\\p{N}\r\n]+|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
# DeepSeek V3's three splits (DeepSeek-R1-Distill-Qwen, a Qwen2ForCausalLM): llama.cpp's "deepseek-r1-qwen"
DEEPSEEK3_SPLITS = (_r(r"\\p{N}{1,3}"), _r(r"[一-龥぀-ゟ゠-ヿ]+"),
                    _r(r"[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
                       r"[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"))
KNOWN_SPLITS: dict[tuple[str, ...], str] = {
    (LLAMA3_SPLIT,): "llama-bpe", (QWEN2_SPLIT,): "qwen2", (TEKKEN_SPLIT,): "tekken", (GPT4O_SPLIT,): "gpt-4o",
    (SEED_CODER_SPLIT,): "seed-coder", DEEPSEEK3_SPLITS: "deepseek-r1-qwen"}


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
        raise GgufKindError(f"{folder}: {what}: the GGUF export writes byte-level BPE tokenizers (tokenizer.json), "
                            f"and sentencepiece ones for {', '.join(a.lower() for a in SENTENCEPIECE_ARCHS)} only; "
                            f"a GGUF without its tokenizer is not one llama.cpp or Ollama can chat with")
    return json.loads(path.read_text())


def _byte_level(pre: dict) -> bool:
    return pre.get("type") == "ByteLevel" or any(p.get("type") == "ByteLevel" for p in pre.get("pretokenizers") or [])


def _plain(regex: str) -> str:
    """A regex with its line breaks written as escapes: tokenizer.json files hold either."""
    return regex.replace("\r", "\\r").replace("\n", "\\n")


def _split_name(parts: list[dict]) -> str | None:
    """The name of a Sequence of Splits then ByteLevel with its regex off, or of SmolLM's single digits
    then GPT-2's byte-level split (llama.cpp's "smollm": single digits, then GPT-2's regex)."""
    if len(parts) == 2 and parts[0].get("type") == "Digits" and parts[0].get("individual_digits") \
            and parts[1].get("type") == "ByteLevel" and parts[1].get("use_regex", True):
        return "smollm"
    if len(parts) < 2 or parts[-1].get("type") != "ByteLevel" or parts[-1].get("use_regex", True):
        return None
    if any(p.get("type") != "Split" or p.get("invert") or (p.get("behavior") or "Isolated") != "Isolated"
           for p in parts[:-1]):
        return None
    regexes = tuple(_plain((p.get("pattern") or {}).get("Regex") or "") for p in parts[:-1])
    return {tuple(_plain(r) for r in k): v for k, v in KNOWN_SPLITS.items()}.get(regexes)


def pre_tokenizer_name(tok: dict, where: Path) -> str:
    """tokenizer.ggml.pre for tokenizer.json's pre-tokenizer: GPT-2's byte-level split, or split regexes
    llama.cpp implements; anything else is refused (a GGUF splitting text otherwise than the model
    learned answers worse, silently)."""
    pre = tok.get("pre_tokenizer") or {}
    kind = (tok.get("model") or {}).get("type")
    if kind != "BPE" or not _byte_level(pre):
        raise GgufKindError(f"{where / 'tokenizer.json'}: a {kind} tokenizer without a byte-level pre-tokenizer: "
                            f"the GGUF export writes byte-level BPE tokenizers, and sentencepiece ones "
                            f"(tokenizer.model, or a tokenizer.json with byte fallback) for "
                            f"{', '.join(a.lower() for a in SENTENCEPIECE_ARCHS)}")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"          # ByteLevel's own split is GPT-2's regex
    name = _split_name(pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else None
    if name is None:
        raise GgufKindError(f"{where / 'tokenizer.json'}: its pre-tokenizer is none llama.cpp names (the export knows "
                            f"GPT-2's byte-level split, smollm's and the "
                            f"{', '.join(sorted(KNOWN_SPLITS.values()))} splits); "
                            f"a GGUF splitting text otherwise than the model learned would answer worse")
    return name


def is_llama_hf(tok: dict) -> bool:
    """A tokenizer.json of sentencepiece's kind, the one gguf's LlamaHfVocab reads: BPE with byte
    fallback and a Sequence decoder (byte-level BPE has neither)."""
    model = tok.get("model") or {}
    return (model.get("type") == "BPE" and bool(model.get("byte_fallback"))
            and (tok.get("decoder") or {}).get("type") == "Sequence")


def vocab_kind(folder: Path, arch: str) -> str:
    """How the converter writes the folder's tokenizer: "spm" (tokenizer.model, read with sentencepiece),
    "llama_hf" (a tokenizer.json of sentencepiece's kind, gguf's LlamaHfVocab) or "gpt2" (byte-level BPE,
    its pre-tokenizer named); GgufKindError when none fits. Phi-4's GPT2Tokenizer goes the gpt2 way, as
    Phi3MiniModel.set_vocab sends it."""
    config_path = folder / "tokenizer_config.json"
    tok_class = (json.loads(config_path.read_text()) if config_path.is_file() else {}).get("tokenizer_class")
    if arch in SENTENCEPIECE_ARCHS and (folder / "tokenizer.model").is_file() and tok_class != "GPT2Tokenizer":
        return "spm"
    tok = tokenizer_json(folder)
    if arch in SENTENCEPIECE_ARCHS and is_llama_hf(tok):
        return "llama_hf"
    pre_tokenizer_name(tok, folder)
    return "gpt2"


def problem(config: dict, folder: Path | None, name: str) -> str | None:
    """Why a model (its config.json, its folder: None for a catalog size) has no GGUF export; None: it has."""
    if folder is None:
        return f"{name}: a catalog model has no tokenizer, and a GGUF needs one (train from a model folder)"
    try:
        vocab_kind(folder, arch_of(config, f"{name}: config.json"))
    except GgufKindError as e:
        return str(e)
    return None
