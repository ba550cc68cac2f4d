"""The fused linear cross-entropy (issue 48): the output head and the next-token loss in one step whose
forward also works out the gradients, so neither the [tokens, vocab] logits nor a recompute of them is
ever needed in backward. The same contract as modeling.chunked_cross_entropy, which stays the loss on
CPU by default and for the preference objectives' per-row log-probs.

The algorithm is liger-kernel's (liger_kernel/ops/fused_linear_cross_entropy.py): walk the tokens a
chunk at a time; for each chunk compute its logits, softmax in fp32, its loss and the gradient of that
loss w.r.t. the chunk's hidden rows and (accumulated in fp32) w.r.t. the head's weight; keep only the
gradients; backward multiplies them by the incoming gradient. On CUDA with liger-kernel installed
(the `fused` extra) its Triton kernel does this; elsewhere the torch version below does, on any device."""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F

IGNORE = -100


@functools.cache
def _liger() -> Callable[..., torch.Tensor] | None:
    """liger's fused linear cross-entropy, or None where it does not import (no liger-kernel, no
    Triton: CPU machines, CI). Imported once per process, on first use."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception:       # ImportError, or Triton failing to find a GPU driver as it loads
        return None
    return liger_fused_linear_cross_entropy


def kernel_for(device: torch.device, have_liger: bool | None = None) -> Literal["liger", "torch"]:
    """Which implementation computes the fused loss on `device`: liger's Triton kernel on CUDA where it
    imports, else ours. `have_liger` (None: try the import) lets a test check the choice without a GPU."""
    if device.type != "cuda":
        return "torch"
    available = _liger() is not None if have_liger is None else have_liger
    return "liger" if available else "torch"


def describe(kind: str, device: torch.device) -> str:
    """For the rank's log: which loss this rank trains with (memory.loss resolved) and, fused, whose kernel."""
    return f"fused ({kernel_for(device)})" if kind == "fused" else kind


def _chunk(hc: torch.Tensor, w: torch.Tensor, yc: torch.Tensor, gh: torch.Tensor | None,
           gw: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """One chunk: the sum of its losses; its hidden rows' gradient written into `gh` (that chunk's rows
    of the whole buffer) and its weight gradient added to the fp32 `gw`. The logits are freed here.
    softcap: Gemma 2's final_logit_softcapping, logits = c * tanh(z / c) (its derivative 1 - tanh^2
    scales the logits' gradient)."""
    z = (hc @ w.t()).float()                    # [chunk, vocab] fp32; the matmul's output is freed
    squash = None
    if softcap is not None:
        squash = torch.tanh(z / softcap)
        z = squash * softcap
    logp = torch.log_softmax(z, dim=-1)
    del z
    loss = F.nll_loss(logp, yc, ignore_index=IGNORE, reduction="sum")
    if gh is None and gw is None:
        return loss
    # d loss / d logits = softmax - one_hot(label), zero on ignored rows; built in place in logp's buffer
    g = logp.exp_()
    valid = yc != IGNORE
    g[torch.arange(yc.numel(), device=yc.device), yc.clamp(min=0)] -= 1.0
    g.mul_(valid.unsqueeze(1))
    if squash is not None:
        g.mul_(1.0 - squash.square_())
        del squash
    g_c = g.to(w.dtype)     # in the compute dtype, as the chunked loss's backward hands it to its matmuls
    del g, logp
    if gh is not None:
        torch.mm(g_c, w, out=gh)
    if gw is not None:
        if gw.dtype == g_c.dtype:
            gw.addmm_(g_c.t(), hc)
        else:
            gw.add_(g_c.t() @ hc)       # bf16/fp16 product, summed in fp32 across the chunks
    return loss


class FusedLinearCrossEntropy(torch.autograd.Function):
    """sum over labels != -100 of -log softmax(h @ w.T)[label]; h [tokens, hidden], w [vocab, hidden]."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk_tokens: int,
                grad_enabled: bool, softcap: float | None = None) -> torch.Tensor:
        # needs_input_grad is set under no_grad too: the caller says whether a graph is being recorded
        need_h = grad_enabled and ctx.needs_input_grad[0]
        need_w = grad_enabled and ctx.needs_input_grad[1]
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for i in range(0, y.numel(), chunk_tokens):
            j = i + chunk_tokens
            total += _chunk(h[i:j], w, y[i:j], None if gh is None else gh[i:j], gw, softcap)
        ctx.w_dtype = w.dtype
        ctx.save_for_backward(gh, gw)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Scaled in place: a second backward through this graph would scale twice, so autograd's version
        # check refuses it (the saved buffers were modified) rather than return wrong gradients.
        gh, gw = ctx.saved_tensors
        dh = None if gh is None else gh.mul_(grad_out.to(gh.dtype))
        dw = None if gw is None else gw.mul_(grad_out).to(ctx.w_dtype)
        return dh, dw, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               chunk_tokens: int = 4096, reduction: str = "mean", kernel: str | None = None,
                               softcap: float | None = None):
    """Next-token loss over the labels that are not -100, as modeling.chunked_cross_entropy (the same
    contract: reduction="mean" is the mean over those labels, 0 with a zero gradient when there are
    none; "sum" is (sum of their losses, their count as a tensor)) but fused: no logits are kept for
    backward and none are recomputed. Peak: one chunk's logits in fp32 and their gradient, the hidden
    states' gradient and the fp32 weight gradient, both held from forward until backward.
    kernel: "liger" or "torch" (None: kernel_for the device; the GPU benchmark compares both).
    softcap: the model's final_logit_softcapping (None: none), applied by either kernel."""
    h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    y = labels.reshape(-1).contiguous()
    count = (y != IGNORE).sum()
    if (kernel or kernel_for(h.device)) == "liger":
        liger = _liger()
        if liger is None:
            raise RuntimeError("the fused loss's liger kernel does not import: pip install 'shardconsole[fused]' "
                               "(liger-kernel; CUDA and Triton)")
        # Its "sum" (its "mean" divides by a zero count when every label is -100): the division is ours,
        # as in the torch path, so both give the same contract. fp32 weight-gradient accumulation, as ours.
        total = liger(h, weight, y, ignore_index=IGNORE, reduction="sum", accum_dtype=torch.float32,
                      softcap=softcap)
    else:
        total = FusedLinearCrossEntropy.apply(h, weight, y, chunk_tokens, torch.is_grad_enabled(), softcap)
    if reduction == "sum":
        return total, count
    return total / count.clamp(min=1)
