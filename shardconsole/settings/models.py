"""Model shapes: the catalog of named Llama-style sizes and local Hugging Face model directories.

Only shapes live here (dicts that LlamaConfig accepts), read without torch or transformers, so the
console and the planner can size a model instantly. The ranks turn a ModelSpec into a module in
backends/rank/common.py.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from shardconsole.settings.paths import PathError, kind_of, shown

# Sizes to train from random init or to plan. "1b" is the 0.95B model of the baselines in docs/MEASURED.md,
# "3b" the 3.1B one; 7b and 13b have Llama-2's shapes (the measured history uses these). The rest are
# today's models, each its family's real config.json less nothing the planner or the ranks read: grouped-query
# attention, their vocabularies, head_dim, qk-norm (qwen3), rope and tying as released.
CATALOG: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=176, vocab_size=256, max_position_embeddings=2048),
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
               intermediate_size=5504, vocab_size=32000, max_position_embeddings=4096),
    "3b": dict(hidden_size=3072, num_hidden_layers=26, num_attention_heads=24, num_key_value_heads=24,
               intermediate_size=8192, vocab_size=32000, max_position_embeddings=4096),
    "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
               intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096),
    "13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                intermediate_size=13824, vocab_size=32000, max_position_embeddings=4096),
    # meta-llama/Llama-3.1-8B: 8,030,261,248 parameters
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                      rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192)),
    # Qwen/Qwen3-8B: 8,190,735,360
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     bos_token_id=151643, eos_token_id=151645),
    # Qwen/Qwen3-14B: 14,768,307,200
    "qwen3-14b": dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, intermediate_size=17408, vocab_size=151936,
                      max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      bos_token_id=151643, eos_token_id=151645),
    # mistralai/Mistral-Small-24B-Base-2501: 23,572,403,200
    "mistral-small-24b": dict(model_type="mistral", hidden_size=5120, num_hidden_layers=40, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=128, intermediate_size=32768, vocab_size=131072,
                              max_position_embeddings=32768, rope_theta=100000000.0, sliding_window=None,
                              bos_token_id=1, eos_token_id=2),
}
_COMMON = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               initializer_range=0.02, hidden_act="silu", attention_bias=False, mlp_bias=False)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class ModelError(ValueError):
    pass


# Mixture-of-experts configs whose parameters are counted (every decoder layer sparse, the experts of
# transformers' fused [experts, 2*inter, hidden] / [experts, hidden, inter] layout): model_type ->
# (experts key, expert intermediate key, shared-expert intermediate key or None).
MOE_TYPES = {"mixtral": ("num_local_experts", "intermediate_size", None),
             "olmoe": ("num_experts", "intermediate_size", None),
             "qwen3_moe": ("num_experts", "moe_intermediate_size", None),
             "qwen2_moe": ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")}
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "n_shared_experts")


# Where families differ from Llama in what they count (transformers' modeling_*.py of each): q/k norms over
# one head's dim ("head") or over all of q and of kv ("full"); norms a layer beside the two of a Llama block
# (Gemma's pre/post-attention and pre/post-feed-forward); biases on q, k and v that no config key announces.
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "gemma3": "head", "olmo2": "full",
           "olmoe": "full"}
NORMS_PER_LAYER = {"gemma2": 4, "gemma3_text": 4, "gemma3": 4}
QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_moe"})
FUSED_PROJ_TYPES = frozenset({"phi3"})      # one qkv_proj and one gate_up_proj Linear a layer


@dataclass(frozen=True)
class Moe:
    experts: int             # routed experts per layer
    top_k: int               # experts each token goes through
    expert_inter: int        # one expert's intermediate size
    shared_inter: int        # the shared expert's (0: none)
    qk_norm: str             # "" | "head" (qwen3_moe: RMSNorm over head_dim) | "full" (olmoe: over q and kv)


def moe_of(config: dict[str, Any], where: str = "config.json") -> Moe | None:
    """The experts of a mixture-of-experts config; None for a dense model. ModelError for an MoE whose
    parameters the planner cannot count (another layout, or dense and sparse layers mixed): a plan
    that counted it as dense said 17.0M parameters and "fits" for a model that used 9.7 GiB."""
    if not any(isinstance(config.get(k), int) and cast(int, config.get(k)) > 1 for k in _EXPERT_KEYS):
        return None
    model_type: Any = config.get("model_type")         # any JSON value
    known = MOE_TYPES.get(model_type)
    if known is None:
        raise ModelError(f"{where}: a mixture-of-experts model ({model_type}) whose experts shardconsole cannot "
                         f"count, so no plan of its memory would be true; counted: {', '.join(MOE_TYPES)}")
    mixed = config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1 \
        or config.get("first_k_dense_replace")
    if mixed:
        raise ModelError(f"{where}: a {model_type} model with dense and sparse layers mixed (mlp_only_layers, "
                         f"decoder_sparse_step): its parameters are not counted; every layer sparse is")
    experts_key, inter_key, shared_key = known
    # transformers renames keys between releases (qwen3_moe's num_experts is num_local_experts in 5.x)
    experts = next(int(config[k]) for k in (experts_key, "num_local_experts", "num_experts") if config.get(k))
    return Moe(experts=experts, top_k=int(config.get("num_experts_per_tok") or 2),
               expert_inter=int(config[inter_key]),
               shared_inter=int(config.get(shared_key) or 0) if shared_key else 0,
               qk_norm=QK_NORM.get(model_type, ""))


@dataclass(frozen=True)
class ModelSpec:
    name: str                       # catalog name or the directory as given
    config: dict[str, Any]          # kwargs for transformers' config class
    path: str | None = None         # local directory, None for catalog models
    has_weights: bool = False
    has_tokenizer: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hidden(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def vocab(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def n_params(self) -> int:
        """Every parameter, embeddings included (the N of the MFU formula in docs/MEASURED.md)."""
        c = self.config
        h, L, V = self.hidden, self.layers, self.vocab
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or h // heads)
        inter = int(c["intermediate_size"])
        attn = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
        model_type = c.get("model_type", "llama")
        if c.get("attention_bias"):
            attn += heads * head_dim + 2 * kv * head_dim + h
        elif c.get("qkv_bias") or model_type in QKV_BIAS_TYPES:      # qwen2's: q, k and v, not o
            attn += heads * head_dim + 2 * kv * head_dim
        attn += {"head": 2 * head_dim, "full": heads * head_dim + kv * head_dim}.get(QK_NORM.get(model_type, ""), 0)
        moe = moe_of(c)
        if moe is None:
            mlp = 3 * h * inter
        else:   # the routed experts, the router, and a shared expert with its gate
            mlp = moe.experts * 3 * h * moe.expert_inter + moe.experts * h
            mlp += 3 * h * moe.shared_inter + h if moe.shared_inter else 0
        norms = NORMS_PER_LAYER.get(model_type, 2) * h
        per_layer = attn + mlp + norms
        embed = V * h
        head = 0 if c.get("tie_word_embeddings") else V * h
        return L * per_layer + embed + head + h

    def flops_per_token(self, seq_len: int, trained: int | None = None, saved: int = 0) -> float:
        """Training FLOPs per token: 6N + 12 L h s (docs/MEASURED.md's definition, so MFU figures compare).

        Adapters (train.method lora / qlora; `trained` parameters, `saved` of them lora.modules_to_save's
        full copies): what the method computes. A frozen weight costs its forward (2) and the backward's
        gradient to its input (2), no gradient to itself: 4 a parameter; a trained one (adapter or copy)
        6; a saved module's frozen original is not computed at all. Attention's 12 L h s stays (its
        backward is all gradients to activations). The forward recomputed under activation checkpointing
        is not counted, as for full fine-tuning: model FLOPs, not the hardware's."""
        attention = 12.0 * self.layers * self.hidden * seq_len
        if trained is None:
            return 6.0 * self.n_params + attention
        return 4.0 * (self.n_params - saved) + 6.0 * trained + attention


def human_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}" if n < 10 * div else f"{n / div:.1f}{unit}"
    return str(n)


# A Hugging Face Hub model id: one organisation and one name, no path of this machine's.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def resolve(name: str) -> ModelSpec:
    """A catalog name or a local model directory (it needs config.json; weights are optional here)."""
    if name in CATALOG:
        return ModelSpec(name=name, config={**_COMMON, **CATALOG[name]})
    path = Path(name).expanduser()
    try:
        found = kind_of(path)
        cfg_kind = kind_of(path / "config.json") if found == "folder" else None
    except PathError as e:
        raise ModelError(f"model {e}") from None
    if found == "missing":
        if _HUB_ID.match(name):
            # a Hub id (org/name): the runs never reach the network, so the folder comes first
            raise ModelError(f"model {name!r}: not a catalog size ({', '.join(CATALOG)}) nor a local folder; a "
                             f"Hugging Face Hub model must be downloaded first, on a machine with network: "
                             f"hf download {name} --local-dir DIR (a gated model needs `hf auth login` and its "
                             f"licence accepted), then model.name = \"DIR\" (runs never reach the network)")
        raise ModelError(f"model {shown(name)!r}: not a catalog size ({', '.join(CATALOG)}) and no such folder")
    if found != "folder":
        got = "a file" if found == "file" else found
        raise ModelError(f"model {shown(name)!r}: expected a Hugging Face model folder, got {got}")
    cfg_file = path / "config.json"
    if cfg_kind not in ("file", "missing"):
        raise ModelError(f"{cfg_file}: is {cfg_kind}, not a regular file")
    try:
        config = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ModelError(f"{cfg_file}: missing; a model folder needs config.json") from None
    except OSError as e:
        raise ModelError(f"{cfg_file}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{cfg_file}: expected a JSON object")
    raw = config
    # Multimodal / nested configs keep the language model under text_config.
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type", "llama")}
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in config]
    if missing:
        raise ModelError(f"{cfg_file}: not a decoder-only transformer config (missing {', '.join(missing)})")
    _check_buildable(raw, cfg_file)
    moe_of(config, str(cfg_file))      # an MoE it cannot count is refused here, before any plan
    has_weights = any((path / f).exists() for f in WEIGHT_FILES)
    has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    return ModelSpec(name=name, config=config, path=str(path.resolve()), has_weights=has_weights,
                     has_tokenizer=has_tok)



@functools.cache
def causal_lm_types() -> frozenset[str] | None:
    """The model_type values transformers' AutoModelForCausalLM builds, read from its source text: importing
    transformers would take seconds and pull torch into the console. None when it cannot be read (then
    nothing is refused on this ground; the ranks still say what they cannot build)."""
    try:
        spec = importlib.util.find_spec("transformers")
        # no spec (None): the AttributeError below says transformers cannot be read
        root = Path(next(iter(spec.submodule_search_locations or [])))    # type: ignore[union-attr]
        text = (root / "models" / "auto" / "modeling_auto.py").read_text()
        start = text.index("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = OrderedDict(")
        block = text[start:text.index("\n)\n", start)]
    except (AttributeError, StopIteration, OSError, ValueError):
        return None
    found = frozenset(re.findall(r'\(\s*"([\w-]+)",', block))
    return found or None


def _check_buildable(config: dict[str, Any], cfg_file: Path) -> None:
    """Refuse up front what the ranks could only crash on: a model that needs the folder's own code
    (shardconsole never runs it: no trust_remote_code), or a model_type transformers cannot build as a
    causal LM."""
    if "auto_map" in config:
        raise ModelError(f"{cfg_file}: the model needs its own code (auto_map); shardconsole trains only "
                         f"architectures transformers ships and never runs a model folder's code")
    model_type = config.get("model_type")
    known = causal_lm_types()
    if known is None:
        return
    if not isinstance(model_type, str) or not model_type:
        raise ModelError(f"{cfg_file}: no model_type; transformers needs it to know the architecture")
    if model_type not in known:
        raise ModelError(f"{cfg_file}: model_type {model_type!r} is not a causal language model that this "
                         f"transformers builds (AutoModelForCausalLM); use a decoder-only model such as llama")
