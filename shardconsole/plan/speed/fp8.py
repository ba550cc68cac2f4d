"""precision.fp8 in the speed model (issues 48 and 63): how much faster the decoder layers run in float8,
from the probe's layers and the runs' whole steps. Pure arithmetic."""

from __future__ import annotations

# precision.fp8: a compiled 7B-shaped decoder layer's forward + backward in float8 against bf16 (torchao, mb 6 x
# 2048, H200: 100.3 ms bf16, 70.0 tensorwise, 85.4 rowwise; benchmarks/results/issue48/fp8_probe_*).
FP8_LAYER_SPEEDUP = {"tensorwise": 1.43, "rowwise": 1.17}
# ... but under full activation checkpointing whole runs gain with the tokens a micro-batch. A layer casts its
# weights to float8 in forward, in the recompute and in backward, a cost a step that does not grow with the tokens,
# while the matmuls' saving does; so a small micro-batch loses and a large one gains what the probe's layers gained.
# Runs, one call a pair, 10 steps (benchmarks/results/issue48/20261205-h100/, 20261205/, 20261205-h200-b/), fp8
# against bf16 at 8,192 tokens: 3b adamw8bit 0.80x and 0.88x (H100), 1.01x (H200); at 16,384: 3b 1.30x (H200, 28,321
# against 21,833); 7B fp32 masters offloaded: 1.15x at 24,576 (H100), and mb 14 fp8 9,647 against mb 12 bf16 7,971
# (H200; these offloaded ones have their own line below). The rule, for the layers' share of the step:
# FP8_CKPT_SMALL at <= FP8_CKPT_TOKENS[0] tokens a micro-batch, FP8_CKPT_LARGE (about the probe's 1.43x) from [1], a
# straight line between; the head and the launches unchanged. Fitted to those five runs, it plans them within -0.6%
# .. +9.7% (the H100's 3b at mb 4, whose own bf16 twin moved 12% between calls); the rule before (0.80 at 8,192 up
# to 1.25 at 24,576, fitted to the H100 alone) planned the H200's 3b at mb 8 22% low. Rowwise under checkpointing
# was not measured: predicted as bf16.
FP8_CKPT_TOKENS = (8192, 16384)
FP8_CKPT_SMALL = {"tensorwise": 0.85, "rowwise": 1.0}
FP8_CKPT_LARGE = {"tensorwise": 1.40, "rowwise": 1.0}
# Under CPU offload (parameters on the host) the same line sits higher: fp8 cost the 13B (Llama-2 shape) bf16
# masters + stochastic recipe at mb 9 x 2048 (18,432 tokens, 24 GiB cap, H200) 16% (3,505 tokens/s against bf16's
# 4,175; its GPU part 4.74 s against 4.41), gained 4% on llama3-8b adam-mini at 24,576 (8,010 against 7,699, H100)
# and 15% on 7B fp32 masters at 24,576 (H100), and mb 14 (28,672) ran 9,647 against mb 12 bf16's 7,971 (H200). One
# reading (not isolated by a run): each layer's weights arrive from the host every micro-batch and are cast after
# their copy lands, so the casts wait on the copies instead of running under the previous layer's matmuls: a cost a
# micro-batch that the saving outgrows only at larger micro-batches. FP8_OFFLOAD_SMALL at <= 18,432 tokens,
# FP8_CKPT_LARGE from 28,672 (break-even ~22,400): the four runs planned at -7%, +11%, +13% and +0.5% (the 8B's and
# the 7B's bf16 twins themselves plan 13% and 6% slow); fitted to these four runs alone.
FP8_OFFLOAD_TOKENS = (18432, 28672)
FP8_OFFLOAD_SMALL = {"tensorwise": 0.75, "rowwise": 1.0}


def fp8_even_tokens(recipe: str, offloaded: bool = False) -> int:
    """Tokens a micro-batch from which fp8's checkpointed layers break even (the rule's 1.0x point)."""
    lo, hi = FP8_OFFLOAD_TOKENS if offloaded else FP8_CKPT_TOKENS
    small, large = (FP8_OFFLOAD_SMALL if offloaded else FP8_CKPT_SMALL)[recipe], FP8_CKPT_LARGE[recipe]
    if small >= 1.0 or large <= small:
        return lo
    return int(round(lo + (hi - lo) * (1.0 - small) / (large - small), -2))


def fp8_checkpointed_speedup(recipe: str, tokens_mb: int, offloaded: bool = False) -> float:
    """How much faster fully checkpointed decoder layers run in float8 at this many tokens a micro-batch."""
    lo, hi = FP8_OFFLOAD_TOKENS if offloaded else FP8_CKPT_TOKENS
    small = (FP8_OFFLOAD_SMALL if offloaded else FP8_CKPT_SMALL)[recipe]
    at = min(1.0, max(0.0, (tokens_mb - lo) / (hi - lo)))
    return small + at * (FP8_CKPT_LARGE[recipe] - small)
