"""The model's shape, from its config alone (nothing is built), and the element counts of its
parameters as FSDP2 shards them and as pinned host memory rounds them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardconsole.settings.models import ModelSpec


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

    @classmethod
    def of(cls, spec: ModelSpec) -> "Shapes":
        c = spec.config
        h = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        return cls(hidden=h, layers=int(c["num_hidden_layers"]), vocab=int(c["vocab_size"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or h // heads), intermediate=int(c["intermediate_size"]),
                   tied=bool(c.get("tie_word_embeddings", False)), attention_bias=bool(c.get("attention_bias")),
                   mlp_bias=bool(c.get("mlp_bias")))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> list[tuple[int, ...]]:
        """Shapes of one decoder layer's parameters (nn.Linear weight is [out, in])."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        out: list[tuple[int, ...]] = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i), (h,), (h,)]
        if self.attention_bias:
            out += [(q,), (kv,), (kv,), (h,)]
        if self.mlp_bias:
            out += [(i,), (i,), (h,)]
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


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _shard_numel(shape: tuple[int, ...], world: int) -> int:
    """FSDP2 shards dim 0 and pads it to a multiple of the world size (_fsdp_param.py)."""
    rows = -(-shape[0] // world)
    return rows * math.prod(shape[1:])


def pow2_ceil(n: int) -> int:
    """PyTorch's CachingHostAllocator rounds every pinned allocation up to a power of two
    (aten/src/ATen/core/CachingHostAllocator.h: c10::llvm::PowerOf2Ceil; the default
    pinned_max_round_threshold is unlimited)."""
    return 1 << (n - 1).bit_length() if n > 1 else n
