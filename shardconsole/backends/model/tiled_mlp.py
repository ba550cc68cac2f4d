"""memory.mlp_tile_tokens (issue 62): each decoder layer's MLP computed a tile of tokens at a time, so no
[tokens x intermediate] tensor is ever whole (the idea of DeepSpeed's ALST TiledMLP and axolotl's).

At seq 32,768 an 8B's MLP makes four [32,768 x 14,336] bf16 tensors that its backward keeps (gate, SiLU,
up, their product: 3.5 GiB) and three more while it runs; with checkpointing they come back in every
layer's recompute, the largest GPU part of a long-context step once the layer inputs are offloaded. The
forward here runs the MLP tile by tile without a graph and keeps only its input; the backward runs each
tile again with one, and backpropagates it at once: one tile's intermediates alive at a time, the
parameters' gradients accumulated over the tiles as autograd accumulates any gradient. The MLP is
pointwise in the tokens, so the result is the same up to the summation order of the gradients.
FSDP2 only: ZeRO-3 reduces a parameter's gradient at its first accumulation (refused in the settings).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[[torch.Tensor], torch.Tensor], tile: int, x: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.tile = fn, tile
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            out = torch.cat([fn(part) for part in flat.split(tile)])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        dx = torch.empty_like(flat) if x.requires_grad else None
        for i in range(0, flat.shape[0], ctx.tile):
            part = flat[i:i + ctx.tile].detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(part)
            torch.autograd.backward(out, g[i:i + ctx.tile])
            if dx is not None:
                dx[i:i + ctx.tile] = part.grad
        return None, None, None if dx is None else dx.reshape(x.shape)


def tile_(mlp: nn.Module, tile: int) -> None:
    """Compute `mlp` (a decoder layer's feed-forward) `tile` tokens at a time, by wrapping its forward.
    Kept out of torch.compile's graph: a backward that runs autograd itself cannot be traced."""
    inner = mlp.forward

    @torch.compiler.disable
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= tile:
            return inner(x)
        return _Tiled.apply(inner, tile, x)

    mlp.forward = forward


def apply(layers: nn.ModuleList, tile: int) -> int:
    """Each layer's `mlp` tiled; returns how many (a layer without one is left as it is)."""
    count = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, nn.Module):
            tile_(mlp, tile)
            count += 1
    return count
