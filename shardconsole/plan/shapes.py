"""The model's shape, from its config alone (nothing is built), and the element counts of its
parameters as FSDP2 shards them and as pinned host memory rounds them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardconsole.settings.models import FUSED_PROJ_TYPES, NORMS_PER_LAYER, QK_NORM, QKV_BIAS_TYPES, ModelSpec, Moe, moe_of


# ---------------------------------------------------------------------------------------------------
# The model's shape, from its config alone

@dataclass(frozen=True)
class Shapes:
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    attention_bias: bool
    mlp_bias: bool
    moe: Moe | None = None      # the experts of a mixture-of-experts model (settings.models.moe_of)
    qkv_bias: bool = False      # qwen2's biases on q, k and v (not o)
    qk_norm: str = ""           # "" | "head" (RMSNorm over head_dim: qwen3, gemma3) | "full" (over q and kv: olmo2)
    norms: int = 2              # norm weights a layer (Gemma's four)
    fused_proj: bool = False    # Phi-3's qkv_proj [q + 2 kv, h] and gate_up_proj [2 i, h]
    model_type: str = "llama"

    @classmethod
    def of(cls, spec: ModelSpec) -> "Shapes":
        c = spec.config
        h = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        moe = moe_of(c)
        # An MoE token passes through top_k experts and the shared one: that is its MLP's activation width.
        inter = int(c["intermediate_size"]) if moe is None else moe.top_k * moe.expert_inter + moe.shared_inter
        return cls(hidden=h, layers=int(c["num_hidden_layers"]), vocab=int(c["vocab_size"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or h // heads), intermediate=inter,
                   tied=bool(c.get("tie_word_embeddings", False)), attention_bias=bool(c.get("attention_bias")),
                   mlp_bias=bool(c.get("mlp_bias")), moe=moe,
                   qkv_bias=(bool(c.get("qkv_bias")) or c.get("model_type") in QKV_BIAS_TYPES)
                   and not c.get("attention_bias"),
                   qk_norm=QK_NORM.get(str(c.get("model_type")), ""),
                   norms=NORMS_PER_LAYER.get(str(c.get("model_type")), 2),
                   fused_proj=c.get("model_type") in FUSED_PROJ_TYPES, model_type=str(c.get("model_type", "llama")))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> list[tuple[int, ...]]:
        """Shapes of one decoder layer's parameters (nn.Linear weight is [out, in])."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        out: list[tuple[int, ...]] = [(q + 2 * kv, h)] if self.fused_proj else [(q, h), (kv, h), (kv, h)]
        out.append((h, q))
        if self.moe is None:
            out += [(2 * i, h), (h, i)] if self.fused_proj else [(i, h), (i, h), (h, i)]
        else:
            out += self._expert_params()
        out += [(h,)] * self.norms
        if self.qk_norm == "head":
            out += [(self.head_dim,), (self.head_dim,)]
        elif self.qk_norm == "full":
            out += [(self.q_dim,), (self.kv_dim,)]
        if self.attention_bias:
            out += [(q,), (kv,), (kv,), (h,)]
        elif self.qkv_bias:
            out += [(q,), (kv,), (kv,)]
        if self.mlp_bias and self.moe is None:
            out += [(i,), (i,), (h,)]
        return out

    def _expert_params(self) -> list[tuple[int, ...]]:
        """transformers' fused experts ([E, 2*inter, h] gate and up, [E, h, inter] down), the router
        [E, h], and a shared expert with its [1, h] gate."""
        m, h = self.moe, self.hidden
        assert m is not None
        out: list[tuple[int, ...]] = [(m.experts, 2 * m.expert_inter, h), (m.experts, h, m.expert_inter),
                                      (m.experts, h)]
        if m.shared_inter:
            out += [(m.shared_inter, h), (m.shared_inter, h), (h, m.shared_inter), (1, h)]
        return out

    def root_params(self) -> list[tuple[int, ...]]:
        """Parameters outside the decoder layers: embedding, final norm, output head (unless tied)."""
        out: list[tuple[int, ...]] = [(self.vocab, self.hidden), (self.hidden,)]
        if not self.tied:
            out.append((self.vocab, self.hidden))
        return out

    @property
    def per_layer(self) -> int:
        return sum(math.prod(s) for s in self.layer_params())

    @property
    def root(self) -> int:
        return sum(math.prod(s) for s in self.root_params())

    @property
    def n_params(self) -> int:
        return self.layers * self.per_layer + self.root

    def all_params(self) -> list[tuple[int, ...]]:
        return self.layer_params() * self.layers + self.root_params()


def shape_numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def shard_numel(shape: tuple[int, ...], world: int) -> int:
    """FSDP2 shards dim 0 and pads it to a multiple of the world size (_fsdp_param.py)."""
    rows = -(-shape[0] // world)
    return rows * math.prod(shape[1:])


def pow2_ceil(n: int) -> int:
    """PyTorch's CachingHostAllocator rounds every pinned allocation up to a power of two
    (aten/src/ATen/core/CachingHostAllocator.h: c10::llvm::PowerOf2Ceil; the default
    pinned_max_round_threshold is unlimited)."""
    return 1 << (n - 1).bit_length() if n > 1 else n
