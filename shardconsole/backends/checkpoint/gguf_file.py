"""A Hugging Face model folder written as one GGUF file (llama.cpp, Ollama, LM Studio), in f16, bf16 or q8_0.

The format is llama.cpp's own `gguf` package: its writer, its tensor name map (the Hugging Face names each
architecture's GGUF names come from) and its quantizer, so the file is what llama.cpp's loader expects,
not a reading of the spec of ours. What is ours is what llama.cpp's convert_hf_to_gguf.py does per family
on top of the package, and that is followed here family by family:

- llama (Llama 3, and Mistral, which llama.cpp runs as the llama architecture): the q and k projections
  permuted back from Hugging Face's rotary layout (halves) to llama.cpp's (interleaved pairs), and Llama
  3.1+'s "llama3" rope scaling written as a rope_freqs tensor;
- qwen2 / qwen3: the names alone (q/k/v biases, qk-norm map through the package);
- gemma3: every `*norm.weight` + 1 (Gemma's RMSNorm scales by 1 + w; llama.cpp's by w), the embedding
  cut to the tokenizer's rows, the global and the sliding layers' rope bases;
- phi3: the fused qkv_proj and gate_up_proj as they are (llama.cpp splits them), the rotary dimension
  from partial_rotary_factor, longrope's factors as tensors.

One tensor is read, converted and written at a time (the header first, from the safetensors headers'
shapes), so the host holds one tensor and its converted copy, not the model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from shardconsole.backends.checkpoint import gguf_vocab
from shardconsole.settings.gguf_kinds import GGUF_TYPES, GgufKindError, arch_of


@dataclass(frozen=True)
class Family:
    arch: str                 # gguf.MODEL_ARCH member name
    permute_qk: bool = False  # llama arch: undo Hugging Face's rotary permutation of q / k
    norm_shift: float = 0.0   # gemma3: (1 + w) norms


def family_of(config: dict, where: Path) -> Family:
    arch = arch_of(config, where / "config.json")
    return Family(arch, permute_qk=arch == "LLAMA", norm_shift=1.0 if arch == "GEMMA3" else 0.0)


@dataclass(frozen=True)
class Written:
    path: Path
    arch: str
    n_tensors: int
    n_bytes: int


def _rope(config: dict) -> dict:
    """transformers 5 keeps rope settings in rope_parameters (per layer kind for Gemma 3); 4.x in
    rope_theta / rope_scaling."""
    rp = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "rope_theta" not in rp and "full_attention" not in rp and config.get("rope_theta") is not None:
        rp["rope_theta"] = config["rope_theta"]
    if "rope_type" not in rp and rp.get("type") is not None:
        rp["rope_type"] = rp["type"]
    return rp


def _common_meta(config: dict) -> dict[str, Any]:
    """convert_hf_to_gguf.py's TextModel.set_gguf_parameters for a dense decoder: {writer method: value}."""
    rp = _rope(config)
    full = rp.get("full_attention", rp)
    meta: dict[str, Any] = {
        "add_block_count": config["num_hidden_layers"],
        "add_context_length": config.get("max_position_embeddings"),
        "add_embedding_length": config["hidden_size"],
        "add_feed_forward_length": config.get("intermediate_size"),
        "add_head_count": config["num_attention_heads"],
        "add_head_count_kv": config.get("num_key_value_heads"),
    }
    kind, factor = full.get("rope_type"), full.get("factor")
    import gguf
    if kind == "linear" and factor is not None:
        meta["add_rope_scaling_type"] = gguf.RopeScalingType.LINEAR
        meta["add_rope_scaling_factor"] = factor
    elif kind == "yarn" and factor is not None:
        meta["add_rope_scaling_type"] = gguf.RopeScalingType.YARN
        meta["add_rope_scaling_factor"] = factor
        meta["add_rope_scaling_orig_ctx_len"] = full["original_max_position_embeddings"]
    elif kind in ("su", "longrope"):
        meta["add_rope_scaling_type"] = gguf.RopeScalingType.LONGROPE
    if full.get("rope_theta") is not None:
        meta["add_rope_freq_base"] = full["rope_theta"]
    if (rp.get("sliding_attention") or {}).get("rope_theta") is not None:
        meta["add_rope_freq_base_swa"] = rp["sliding_attention"]["rope_theta"]
    if config.get("rms_norm_eps") is not None:
        meta["add_layer_norm_rms_eps"] = config["rms_norm_eps"]
    if config.get("head_dim") is not None:
        meta["add_key_length"] = meta["add_value_length"] = config["head_dim"]
    return {k: v for k, v in meta.items() if v is not None}


def family_meta(family: Family, config: dict) -> dict[str, Any]:
    """The family's hyperparameters as its converter class writes them."""
    if family.arch == "PHI3":        # Phi3MiniModel writes its own set, not the common one
        rp = _rope(config)
        n_embd, n_head = config["hidden_size"], config["num_attention_heads"]
        rot = rp.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        meta = {"add_context_length": config["max_position_embeddings"],
                "add_rope_scaling_orig_ctx_len": config.get("original_max_position_embeddings",
                                                            config["max_position_embeddings"]),
                "add_embedding_length": n_embd, "add_feed_forward_length": config["intermediate_size"],
                "add_block_count": config["num_hidden_layers"], "add_head_count": n_head,
                "add_head_count_kv": config.get("num_key_value_heads", n_head),
                "add_layer_norm_rms_eps": config["rms_norm_eps"],
                "add_rope_dimension_count": int(rot * n_embd) // n_head,
                "add_rope_freq_base": rp.get("rope_theta", 10000.0),
                "add_sliding_window": config.get("sliding_window") or 0}
        if rp.get("rope_type") in ("su", "longrope"):
            import gguf
            meta["add_rope_scaling_type"] = gguf.RopeScalingType.LONGROPE
        return meta
    meta = _common_meta(config)
    if family.arch == "LLAMA":
        meta["add_vocab_size"] = config["vocab_size"]
        meta["add_rope_dimension_count"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    elif family.arch == "GEMMA3":
        head_dim = config.get("head_dim", 256)
        meta.update({"add_context_length": config.get("max_position_embeddings", 131072),
                     "add_head_count": config.get("num_attention_heads", 8),
                     "add_layer_norm_rms_eps": config.get("rms_norm_eps", 1e-6),
                     "add_key_length": head_dim, "add_value_length": head_dim,
                     "add_rope_freq_base": _rope(config).get("full_attention", _rope(config)).get("rope_theta", 1e6),
                     "add_head_count_kv": config.get("num_key_value_heads", 4)})
        if config.get("final_logit_softcapping"):
            meta["add_final_logit_softcapping"] = config["final_logit_softcapping"]
        if config.get("sliding_window_pattern") != 1 and config.get("sliding_window") is not None:
            meta["add_sliding_window"] = config["sliding_window"]
    return meta


def _llama3_rope_freqs(config: dict) -> np.ndarray | None:
    """Llama 3.1+'s frequency-dependent rope scaling, which llama.cpp reads as per-dimension factors
    (the converter's LlamaModel.generate_extra_tensors)."""
    rp = _rope(config)
    if str(rp.get("rope_type", "")).lower() != "llama3":
        return None
    base = rp.get("rope_theta", 10000.0)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor, low, high = rp.get("factor", 8.0), rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old_ctx = rp.get("original_max_position_embeddings", 8192)
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _phi3_rope_factors(config: dict) -> dict[str, np.ndarray]:
    rp = _rope(config)
    if rp.get("rope_type") not in ("su", "longrope"):
        return {}
    return {"rope_factors_long.weight": np.asarray(rp["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.asarray(rp["short_factor"], dtype=np.float32)}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's q/k rows are [first halves of every head's pairs | second halves]; llama.cpp's
    rope takes (x0, x1) pairs side by side: the inverse of the permutation HF's conversion script applied."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise GgufKindError(f"{folder}: no model*.safetensors weights to convert")
    return files


def _hf_tensors(folder: Path) -> Iterator[tuple[str, Any]]:
    """(name, loader) for every weight in the folder's safetensors files, in file order."""
    from safetensors import safe_open
    for path in _weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
        for name in names:
            yield name, (lambda p=path, n=name: _load(p, n))


def _load(path: Path, name: str) -> np.ndarray:
    import torch
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name).to(torch.float32).numpy()


def _qtype(outtype: str, gguf_name: str, ndim: int):
    """As the converter: vectors, norms and rope tables stay F32; matrices take the file's type."""
    import gguf
    T = gguf.GGMLQuantizationType
    if ndim <= 1 or gguf_name.endswith("_norm.weight") or gguf_name.startswith(("rope_freqs", "rope_factors")):
        return T.F32
    return {"f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[outtype]


@dataclass(frozen=True)
class _Plan:
    """One GGUF tensor: its name, final logical shape and type, and how its data is made."""
    name: str
    shape: tuple[int, ...]
    qtype: Any
    make: Any          # () -> np.ndarray (float32, the logical shape)


def _plan(folder: Path, config: dict, family: Family, outtype: str, rows: int | None) -> list[_Plan]:
    import gguf
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    shapes = _shapes(folder)
    plans: list[_Plan] = []
    for name, load in _hf_tensors(folder):
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.get("tie_word_embeddings")):
            continue               # recomputed by llama.cpp / the embedding, as the converter skips them
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise GgufKindError(f"{folder}: the weight {name} has no name in llama.cpp's "
                            f"{gguf.MODEL_ARCH_NAMES[arch]} architecture (a layer this family does not have)")
        shape = shapes[name]

        def make(load=load, name=name) -> np.ndarray:
            data = load()
            if family.permute_qk and name.endswith("q_proj.weight"):
                data = permute_qk(data, n_head)
            elif family.permute_qk and name.endswith("k_proj.weight"):
                data = permute_qk(data, n_kv)
            if family.norm_shift and name.endswith("norm.weight"):
                data = data + family.norm_shift
            if rows is not None and name.endswith("embed_tokens.weight"):
                data = data[:rows]
            return data

        if rows is not None and name.endswith("embed_tokens.weight"):
            shape = (min(rows, shape[0]), *shape[1:])
        plans.append(_Plan(new, shape, _fitting(_qtype(outtype, new, len(shape)), shape), make))
    extra = {}
    if family.arch == "LLAMA" and (freqs := _llama3_rope_freqs(config)) is not None:
        extra["rope_freqs.weight"] = freqs
    if family.arch == "PHI3":
        extra.update(_phi3_rope_factors(config))
    for new, arr in extra.items():
        plans.append(_Plan(new, arr.shape, gguf.GGMLQuantizationType.F32, lambda arr=arr: arr))
    return plans


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers (nothing loaded)."""
    from safetensors import safe_open
    out = {}
    for path in _weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


def _fitting(qtype, shape: tuple[int, ...]):
    """A quantized type whose block the rows do not divide falls back to F16 (the converter's QuantError)."""
    import gguf
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if block > 1 and shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return qtype


def _byte_shape(p: _Plan) -> tuple[tuple[int, ...], Any, int]:
    """The shape, numpy dtype and size add_tensor_info needs for the bytes `_encode` makes."""
    import gguf
    T = gguf.GGMLQuantizationType
    if p.qtype in (T.F32, T.F16):
        dt = np.float32 if p.qtype == T.F32 else np.float16
        return p.shape, np.dtype(dt), int(np.prod(p.shape)) * np.dtype(dt).itemsize
    bshape = gguf.quant_shape_to_byte_shape(p.shape, p.qtype)
    return bshape, np.dtype(np.uint8), int(np.prod(bshape))


FILE_TYPES = {"f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


def write_gguf(folder: Path, out: Path, outtype: str, name: str) -> Written:
    """`folder` (a Hugging Face model folder: config.json, safetensors, tokenizer.json or .model) as the GGUF file
    `out`, its matrices in `outtype`. Refusals are GgufKindError, before the file is opened."""
    import gguf
    if outtype not in GGUF_TYPES:
        raise GgufKindError(f"GGUF type {outtype!r}: one of {', '.join(GGUF_TYPES)}")
    config = json.loads((folder / "config.json").read_text())
    config = {**config, **(config.get("text_config") or {})}
    family = family_of(config, folder)
    tokenizer = gguf_vocab.read_tokenizer(folder, config, family.arch)
    plans = _plan(folder, config, family, outtype, tokenizer.gemma_rows)
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    for method, value in family_meta(family, config).items():
        getattr(writer, method)(value)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[outtype]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    gguf_vocab.add_vocab(writer, tokenizer, config, family.arch)
    total = 0
    for p in plans:
        shape, dtype, nbytes = _byte_shape(p)
        writer.add_tensor_info(p.name, shape, dtype, nbytes, raw_dtype=None if dtype != np.uint8 else p.qtype)
        total += nbytes
    try:
        writer.write_header_to_file(path=out)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in plans:          # one tensor in memory at a time
            data = gguf.quants.quantize(np.ascontiguousarray(p.make(), dtype=np.float32), p.qtype)
            writer.write_tensor_data(data)
    finally:
        writer.close()
    return Written(out, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)], len(plans), total)
