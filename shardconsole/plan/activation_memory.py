"""Activations: the bytes autograd keeps for backward (per decoder layer, by micro-batch, sequence
length, dtype, attention kernel, checkpointing and torch.compile), the loss's buffers (chunked or fused) and
the transient gradient buffers of one layer's backward."""

from __future__ import annotations

from dataclasses import dataclass

from shardconsole.settings import config as C
from shardconsole.plan.constants import DTYPE_BYTES, LOSS_CHUNK_TOKENS
from shardconsole.plan.shapes import Shapes, pow2_ceil


# ---------------------------------------------------------------------------------------------------
# Activations: what autograd keeps for backward, per decoder layer, from the HF Llama code path
# (transformers models/llama/modeling_llama.py) as run by backends/rank/common.py.

def layer_activation_bytes_per_token(s: Shapes, c: int) -> int:
    """Bytes saved for backward by one decoder layer per token, compute dtype of c bytes, SDPA.

    RMSNorm (x2): the fp32 copy of its input (pow and the rsqrt mul save it: 4h), the normalized
    tensor in the compute dtype (the weight mul saves it: c*h) and its output, saved by the next
    linears (c*h). In fp32 the casts are no-ops but the three tensors are still distinct: 4h + 2ch.
    Attention: q and k after RoPE and v (saved by SDPA), SDPA's output (saved by its backward; the
    transpose(1, 2).contiguous() after it is a no-op because flash returns a [b, s, heads, d]
    tensor, so o_proj saves the same storage) and SDPA's fp32 logsumexp per head. RoPE saves only
    cos/sin: q*cos needs cos for q's gradient, and cos needs no gradient.
    MLP: gate out (saved by SiLU), SiLU out and up out (saved by the mul), their product (saved by
    down_proj). Residual adds save nothing.
    For a 0.95B Llama in bf16 that is 24h + 8I = 93,184 bytes a token a layer; the calibration runs
    (fsdp-1b-fp16-mb8, fsdp-1b-bf16-mb4) measured 92-93 k.
    """
    h, q, kv, i = s.hidden, s.q_dim, s.kv_dim, s.intermediate
    norms = 2 * (4 * h + 2 * c * h)
    attn = c * (2 * q + 2 * kv) + 4 * s.heads
    mlp = 4 * c * i
    return norms + attn + mlp


def compiled_layer_activation_bytes_per_token(s: Shapes, c: int) -> int:
    """The same layer under torch.compile (fsdp.py compiles each decoder layer): inductor's partitioner
    saves each RMSNorm's input in the compute dtype and its fp32 rstd, and recomputes the norm in
    backward, instead of the fp32 copy, the normalized tensor and the norm's output; attention and
    MLP keep what they keep eagerly. For the 0.95B model in bf16: 12h + 8I = 68,608 bytes against a
    measured 65.8 k (h200-fsdp vs h200-fsdp-nocompile in benchmarks/data/h200_presets.json)."""
    h, q, kv, i = s.hidden, s.q_dim, s.kv_dim, s.intermediate
    return c * (2 * h + 2 * q + 2 * kv + 4 * i) + 4 * s.heads + 2 * 4


def eager_attention_bytes_per_sample(s: Shapes, seq: int, c: int) -> int:
    """Eager attention also keeps the [heads, seq, seq] probabilities: softmax's fp32 output and its
    cast to the compute dtype (saved by the matmul with v); in fp32 the cast is a no-op. Its output
    is copied by transpose().contiguous() (saved by o_proj, as SDPA's output is) and it keeps no
    logsumexp."""
    return s.heads * seq * seq * (4 + (c if c != 4 else 0))


# ---------------------------------------------------------------------------------------------------
# The loss (memory.loss, backends/model/fused_loss.py): the chunked one keeps a chunk's logits at a time
# and recomputes them in backward; the fused one works out its gradients in forward and keeps those.

def loss_kind(cfg: C.RunConfig) -> str:
    """"chunked", "liger" (the fused loss on CUDA: liger-kernel's, the `fused` extra) or "torch" (the
    fused loss elsewhere: ours). The preference objectives read per-row log-probs, always chunked."""
    if cfg.train.objective != "sft" or cfg.memory.loss_on(cfg.parallel.device != "cpu") == "chunked":
        return "chunked"
    return "torch" if cfg.parallel.device == "cpu" else "liger"


def liger_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """liger's chunk (ops/fused_linear_cross_entropy.py, 0.8.5): about tokens x hidden elements of logits,
    tokens / ceil(vocab / hidden) rounded up to a power of two: 2048 of 12,288 tokens at 32k x 4096,
    512 at 128k."""
    inc = -(-vocab // hidden)
    per = -(-tokens // inc)
    return min(1 << (per - 1).bit_length(), tokens)


def head_trained(cfg: C.RunConfig, s: Shapes) -> bool:
    """Whether the loss's head weight takes a gradient: always in full training; under LoRA/QLoRA only
    when lora.modules_to_save names it (or, tied, the embedding)."""
    saved = cfg.lora.saved_list() if cfg.adapters else []
    return not cfg.adapters or "lm_head" in saved or (s.tied and "embed_tokens" in saved)


def fused_loss_bytes(s: Shapes, c: int, tokens: int, kernel: str, head: bool = True) -> tuple[int, int]:
    """(forward peak, backward) of the fused loss beyond the model's own tensors. Both kernels hold from
    forward until backward the hidden states' gradient ([tokens, hidden], c) and the head's gradient,
    summed over the chunks in an fp32 [vocab, hidden] accumulator; backward only scales them, in place,
    and hands the head's over as its gradient (the phases' "head gradient" entry), so what stays beyond
    it is the hidden one, and (ours, below fp32) the fp32 accumulator it is cast from.
    liger: one chunk's logits in c (torch.mm into one reused buffer; the Triton kernel writes the softmax
    gradient over them and keeps fp32 only in registers), the fp32 losses per token; in fp32 its weight
    update allocates a [vocab, hidden] product per chunk, below fp32 it adds into the fp32 accumulator
    (addmm out_dtype) and casts it to c once, at the end of forward, after the chunk buffer is freed.
    torch (ours): a 4096-token chunk's fp32 log-softmax (4) from the matmul's c output cast to fp32 (4,
    freed: 8 at most), the softmax gradient cast to c (the log-softmax buffer is reused: 4 + c), and
    below fp32 the c [vocab, hidden] product added to the accumulator.
    `head`: the head takes a gradient (head_trained); a frozen head (LoRA) has no accumulator at all."""
    v, h = s.vocab, s.hidden
    hidden_grad = tokens * h * c
    acc, product = (4 * v * h, c * v * h) if head else (0, 0)
    if kernel == "liger":
        chunk = liger_chunk_tokens(tokens, v, h)
        step = chunk * v * c + (acc if c == 4 else 0)
        fwd = acc + hidden_grad + tokens * 4 + max(step, 0 if c == 4 else product)
        return fwd, hidden_grad
    chunk = min(LOSS_CHUNK_TOKENS, tokens)
    fwd = acc + hidden_grad + chunk * v * max(8, 4 + c) + (0 if c == 4 else product)
    return fwd, hidden_grad + (0 if c == 4 else acc)


# precision.fp8 on compiled layers: the layer's saved tensors shrink. Eager, torchao's Float8Linear
# saves its bf16 input and weight (float8_casts below); compiled, the partitioner may keep the float8 casts
# backward needs instead, at a byte a value. Measured, not derived (NVML, one call a pair): 1b h200-fsdp mb 8
# without checkpointing 36.46 -> 32.07 GiB (H100) and 37.7 -> 33.3 (H200), 27% of the 16.96 GiB the
# layers keep in bf16 (the casts' term added back); with it the checkpointed 7B (mb 12) and 3b (mb 4)
# presets' fp8 runs plan within 2.1% (their recomputed layer shrinks), against +6.5% and +1.3% without.
# benchmarks/results/issue48/20261205-h100/. DeepSpeed's compiled layers in float8 keep what FSDP2's do (the
# compiled-layer model, shrunk by the same share; in bf16 they are planned as eager, below): the h200-fsdp
# preset as ZeRO-3 + fp8 tensorwise (1b, mb 8, H200) measured 37.1 and 36.01 GiB NVML (issue48/20261205,
# issue 63) and plans 37.2, where the eager model shrunk planned 41.7 (+16%): fp8 saved 8.1 GiB there
# against bf16's 45.15 and 44.10, more than the eager model's 27% (6.2 GiB).
FP8_COMPILED_SAVED_SHRINK = 0.27


@dataclass
class Activations:
    layers: int
    saved_layer: int         # what one layer keeps until its backward (its input, if checkpointed)
    per_layer: int           # one layer's saved tensors in full (as when it is recomputed)
    recompute: int           # the layer recomputed at its backward (checkpointing), else 0
    final: int               # final norm + the loss input kept by the loss checkpoint
    inputs: int              # token ids (labels are a view of the same batch)
    mask: int                # eager's causal mask, shared by the layers
    layer_backward: int      # transient gradient buffers while one layer runs backward
    loss_forward: int        # one chunk of logits in forward
    loss_backward: int       # one chunk recomputed and differentiated
    alternative_saved: int   # all layers' saved activations with checkpointing flipped
    in_flight: int = 0       # memory.activation_offload: layer inputs on the GPU while copied out or back

    @property
    def saved_all(self) -> int:
        return self.layers * self.saved_layer + self.final + self.inputs + self.mask + self.in_flight


def activations(cfg: C.RunConfig, s: Shapes) -> Activations:
    c = DTYPE_BYTES[cfg.precision.dtype]
    # A preference objective's sample is a pair: its chosen and rejected rows go through the model together
    mb, seq = cfg.train.micro_batch * cfg.rows_per_sample, cfg.data.seq_len
    tokens = mb * seq
    eager = cfg.model.attn_implementation == "eager"
    # Compiled layers under DeepSpeed (stage3_layer_gather) saved less than under FSDP2: 42.9 GiB reserved
    # against 46.3 eager (1b, mb 8, benchmarks/data/h200_issue7b.json), where the compiled-layer model
    # below would plan 40.6 GiB; planned as eager there (48.5 GiB at NVML against 45.1 measured: over), but
    # in float8 (FP8_COMPILED_SAVED_SHRINK's note).
    fp8 = cfg.precision.fp8 != "none"
    compiled = cfg.compiles_layers and (cfg.parallel.backend == "fsdp" or fp8)
    per_token = compiled_layer_activation_bytes_per_token if compiled else layer_activation_bytes_per_token
    per_layer = tokens * per_token(s, c)
    if cfg.compiles_layers and fp8:
        per_layer = int(per_layer * (1.0 - FP8_COMPILED_SAVED_SHRINK))
    if eager:
        per_layer += mb * eager_attention_bytes_per_sample(s, seq, c) - tokens * 4 * s.heads
    ckpt_layer = tokens * c * s.hidden        # a checkpointed layer keeps its input only
    ckpt = cfg.memory.activation_checkpointing
    if ckpt and cfg.memory.checkpoint_policy == "selective":
        # and, selectively, the outputs of its matmuls (q, k, v, o, gate, up, down) and of attention
        # (with its fp32 logsumexp); measured 30.4 GiB reserved against this plan's 30.2 (1b, mb 8,
        # compiled, benchmarks/data/h200_issue7.json)
        ckpt_layer += tokens * (c * (2 * s.hidden + 2 * s.q_dim + 2 * s.kv_dim + 2 * s.intermediate) + 4 * s.heads)
    # Backward through one layer: gradient buffers of the MLP's intermediate tensors (about three
    # [tokens, intermediate] at once) and of the residual stream; eager adds the [heads, seq, seq]
    # gradient of the probabilities (compute dtype) and softmax's backward in fp32 (two buffers).
    # From the autograd graph above; small next to the saved tensors.
    layer_bwd = tokens * (3 * c * s.intermediate + 2 * c * s.hidden)
    tile = cfg.memory.mlp_tile_tokens
    if tile and tile < tokens:
        # memory.mlp_tile_tokens (backends/model/tiled_mlp.py): the MLP keeps its input only; its four saved
        # [tokens, intermediate] tensors and three gradients live one tile at a time, in its backward
        per_layer -= tokens * c * (4 * s.intermediate - s.hidden)
        layer_bwd = tokens * 2 * c * s.hidden + tile * 7 * c * s.intermediate
    if eager:
        layer_bwd += mb * s.heads * seq * seq * (c + 8)
    fused = loss_kind(cfg)
    if fused != "chunked":
        loss_fwd, loss_bwd = fused_loss_bytes(s, c, tokens, fused, head_trained(cfg, s))
    else:
        chunk = min(LOSS_CHUNK_TOKENS, tokens)
        v = s.vocab
        # Loss forward, per chunk: logits (c) -> .float() (4) -> log_softmax output (4).
        loss_fwd = chunk * v * (c + 4 + 4)
        # Loss backward, per chunk: the recomputed log_softmax output (4) + nll_loss's dense gradient (4)
        # + log_softmax's gradient (4); the gradient of the loss input accumulates over the chunks into
        # one [tokens, hidden] buffer (two while adding).
        loss_bwd = chunk * v * 12 + 2 * tokens * s.hidden * c
    # memory.activation_offload (backends/model/activation_offload.py): each layer's input waits on the host;
    # the GPU holds the one being copied out in forward and the one copied back for the layer in backward.
    moved = offloaded_input_bytes(cfg, s)
    return Activations(
        layers=s.layers, saved_layer=(ckpt_layer - moved) if ckpt else per_layer, per_layer=per_layer,
        in_flight=2 * moved,
        # the layer being recomputed holds its saved tensors again; selective keeps part of them anyway
        recompute=(per_layer if cfg.memory.checkpoint_policy == "full" else max(per_layer - ckpt_layer, 0))
        if ckpt else 0,
        # the fused loss saves no input for backward: the final norm's output is not kept
        final=tokens * (4 * s.hidden + (1 if fused != "chunked" else 2) * c * s.hidden),
        inputs=mb * (seq + 1) * 8,
        mask=mb * seq * seq * c if eager else 0,
        layer_backward=layer_bwd, loss_forward=loss_fwd, loss_backward=loss_bwd,
        alternative_saved=s.layers * (per_layer if ckpt else ckpt_layer),
    )


def offloaded_input_bytes(cfg: C.RunConfig, s: Shapes) -> int:
    """One layer's input as memory.activation_offload moves it to the host (0: not offloaded)."""
    if not (cfg.memory.activation_offload and cfg.memory.activation_checkpointing):
        return 0
    tokens = cfg.train.micro_batch * cfg.rows_per_sample * cfg.data.seq_len
    return tokens * s.hidden * DTYPE_BYTES[cfg.precision.dtype]


def offloaded_host(cfg: C.RunConfig, s: Shapes) -> dict[str, int]:
    """The host side of memory.activation_offload: every layer's input, each in a pinned block of torch's
    caching host allocator (a power of two); {} when off."""
    moved = offloaded_input_bytes(cfg, s)
    return {"offloaded activations (layer inputs, pinned)": s.layers * pow2_ceil(moved)} if moved else {}


def float8_casts(cfg: C.RunConfig, s: Shapes) -> dict[str, int]:
    """precision.fp8 (backends/model/float8.py): while a layer computes, torchao holds float8 casts of its
    weights (one for the forward, a transposed one for the input gradient: a byte a weight each) and of
    the widest input of its linears (a byte a value). Eager, its autograd saves the bf16 input and weight
    as a bf16 layer does; compiled, the layer keeps less (FP8_COMPILED_SAVED_SHRINK, in activations)."""
    if cfg.precision.fp8 == "none":
        return {}
    tokens = cfg.train.micro_batch * cfg.rows_per_sample * cfg.data.seq_len
    return {"float8 casts (one layer)": 2 * s.per_layer + tokens * s.intermediate}
