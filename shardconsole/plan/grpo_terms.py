"""What GRPO (train.objective grpo, backends/objective/grpo.py) adds to a step beyond the training rows the
activations already count (micro_batch x generations rows of data.seq_len: prompt and completion):

memory   a moment of its own, "sampling" (sampling_moment): what every moment of the step holds (the
         weights, the optimizer state, the workspaces: each part at its smallest over the step's moments),
         plus the sampler's KV cache, 2 (K, V) x layers x kv_heads x head_dim x compute bytes x micro_batch x
         generations x data.seq_len at its longest, the prefill's working set of a layer, one gathered layer
         where the weights are sharded, and the sampler's tensors over the vocabulary (fp32 logits, softmax,
         top-p's sort, cumsum and scatter). The cache is dropped before the training forward, so the GPU peak
         is the larger of sampling and training (estimator._gpu takes the largest moment), not their sum.
         Full fine-tuning with beta > 0 adds the frozen reference copy at every moment (reference_bytes).
tokens   what the run's step line counts (backends/objective/grpo.py real_tokens): every prompt's and
         completion's tokens, micro_batch x generations rows a micro-batch (step_rows). A completion is counted
         at max_new_tokens, its longest, as the decode time below is; a prompt at an estimate (prompt_tokens):
         the mean of data.path's first prompts in characters (UTF-8 bytes under data.tokenizer "bytes", else
         CHARS_PER_TOKEN a token), cut like the ranks cut them; data.seq_len - max_new_tokens, its bound, where
         the file cannot be read here. The training forward and backward run on those rows at that length.
time     max_new_tokens decode steps a micro-batch, each reading every weight once (FSDP2 and ZeRO-3 also
         all-gather them: the training forward's gather, once a token) or bound by the layers' launches; and
         with adapters and beta > 0 the reference forward (the base, adapters off, no grad).
The decode rates are assumed, not measured (the H200 rows of the issue measure them)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from shardconsole.plan.shapes import Shapes
from shardconsole.settings import config as C

GB = 1e9
# Eager decode of one layer (one token for a batch of rows) through the engines' hooks: assumed 0.3 ms on
# any card (HF Llama layers run about a dozen kernels a token; FSDP2 adds its pre/post hooks)
DECODE_LAYER_S = 0.3e-3
HBM_SHARE = 0.7         # the share of the datasheet bandwidth a decode step's weight reads reach
# Bytes a row holds a vocabulary entry while picking a token (sampler.pick): the fp32 logits, logits /
# temperature, softmax; with top_p < 1 also the sorted probabilities, their int64 order, the cumsum, the drop
# mask, the masked copy and the scattered result.
PICK_BYTES = 12
TOP_P_BYTES = 29
# A prompt's tokens from its characters: about 4 characters a token for English through a BPE tokenizer
# (assumed), one a UTF-8 byte under data.tokenizer "bytes"; a message list's chat template adds some a turn.
CHARS_PER_TOKEN = 4.0
TEMPLATE_TOKENS_PER_TURN = 8
PROMPT_SAMPLE = 256         # the records read for the estimate: the first ones of the file


def _prompt_chars(rec: object) -> tuple[int, int] | None:
    """(characters, turns) of a record's prompt: text, or a message list's contents."""
    value = rec.get("prompt") if isinstance(rec, dict) else None
    if isinstance(value, str):
        return len(value.encode()), 0
    if isinstance(value, list):
        turns = [m for m in value if isinstance(m, dict)]
        return sum(len(str(m.get("content", "")).encode()) for m in turns), len(turns)
    return None


def prompt_tokens(cfg: C.RunConfig) -> tuple[int, str]:
    """Tokens a prompt is planned at, and whence: the mean of data.path's first PROMPT_SAMPLE prompts (a .jsonl
    file), else the bound data.seq_len - max_new_tokens (prompts are cut from the left to it)."""
    bound = max(1, cfg.data.seq_len - cfg.grpo.max_new_tokens)
    path = Path(cfg.data.path) if cfg.data.path else None
    if path is None or path.suffix != ".jsonl" or not path.is_file():
        return bound, f"data.seq_len - max_new_tokens, the bound ({'no .jsonl' if path is None else path.name} read here)"
    per_token = 1.0 if cfg.data.tokenizer == "bytes" else CHARS_PER_TOKEN
    seen: list[float] = []
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in itertools.islice((x for x in f if x.strip()), PROMPT_SAMPLE):
                got = _prompt_chars(json.loads(line))
                if got is not None:
                    seen.append(min(bound, got[0] / per_token + got[1] * TEMPLATE_TOKENS_PER_TURN))
    except (OSError, ValueError):
        seen = []
    if not seen:
        return bound, f"data.seq_len - max_new_tokens, the bound ({path.name}: no prompt read)"
    how = "UTF-8 bytes" if per_token == 1.0 else f"{CHARS_PER_TOKEN:.0f} characters a token"
    return max(1, round(sum(seen) / len(seen))), f"the mean of {path.name}'s first {len(seen)} prompts in {how}"


def step_rows(cfg: C.RunConfig) -> tuple[int, int]:
    """(rows, tokens a row) of a micro-batch as the run trains and counts them: micro_batch x generations rows
    of a prompt (prompt_tokens) and max_new_tokens completion tokens, data.seq_len at most."""
    rows = cfg.train.micro_batch * cfg.grpo.generations
    return rows, min(cfg.data.seq_len, prompt_tokens(cfg)[0] + cfg.grpo.max_new_tokens)


def kv_cache_bytes(cfg: C.RunConfig, s: Shapes) -> int:
    dtype = 4 if cfg.precision.dtype == "fp32" else 2
    rows = cfg.train.micro_batch * cfg.grpo.generations
    return 2 * s.layers * s.kv_heads * s.head_dim * dtype * rows * cfg.data.seq_len


def sampling_moment(cfg: C.RunConfig, s: Shapes, moments: dict[str, dict[str, int]]) -> dict[str, int]:
    """One rank's allocated bytes while sampling, part by part, from the step's other moments."""
    c = 4 if cfg.precision.dtype == "fp32" else 2
    g, rows = cfg.grpo, cfg.train.micro_batch * cfg.grpo.generations
    names = set().union(*moments.values()) if moments else set()
    out = {k: v for k in sorted(names) if (v := min(m.get(k, 0) for m in moments.values()))}
    out["sampling: KV cache"] = kv_cache_bytes(cfg, s)
    # the prefill of the prompts (data.seq_len - max_new_tokens at most), no grad: a layer's residual,
    # normed input and MLP (gate, up, their product) alive at once
    prompt = cfg.data.seq_len - g.max_new_tokens
    out["sampling: prefill (a layer's working set)"] = rows * prompt * (2 * s.hidden + 3 * s.intermediate) * c
    out["sampling: logits and top-p"] = rows * s.vocab * (PICK_BYTES + (TOP_P_BYTES if g.top_p < 1 else 0))
    if cfg.parallel.backend == "fsdp" or cfg.deepspeed.stage == 3:
        # the forward gathers a layer's shards as training's does
        out["sampling: a gathered layer"] = int(s.per_layer * (0.56 if cfg.train.method == "qlora" else c))
    return {k: int(v) for k, v in out.items()}


def reference_bytes(cfg: C.RunConfig, s: Shapes) -> int:
    """Full fine-tuning with beta > 0: the frozen copy of the starting weights (backends/engine/frozen_copy.py),
    resident through the run. FSDP2 shards it as the policy (its kept dtype: fp32, or bf16 masters); ZeRO-3
    partitions it in the compute dtype; ZeRO 0-2 keep it whole on every rank in the compute dtype."""
    g = cfg.grpo
    if cfg.train.objective != "grpo" or not g.beta or cfg.adapters:
        return 0
    p = cfg.parallel
    world = p.nproc_per_node * p.nnodes
    c = 4 if cfg.precision.dtype == "fp32" else 2
    if p.backend == "fsdp":
        shard = {"no_shard": 1, "hybrid_shard": p.nproc_per_node}.get(cfg.fsdp.sharding, world)
        return -(-s.n_params * cfg.kept_bytes // shard)
    return -(-s.n_params * c // world) if cfg.deepspeed.stage == 3 else s.n_params * c


def weight_bytes(cfg: C.RunConfig, n_params: int) -> float:
    """What a decode step reads: the compute copy (QLoRA's NF4 base: about 0.56 bytes a parameter)."""
    if cfg.train.method == "qlora":
        return 0.56 * n_params
    return (4.0 if cfg.precision.dtype == "fp32" else 2.0) * n_params


def generation_s(cfg: C.RunConfig, s: Shapes, n_params: int, hbm_gbps: float, link_gbps: float, ranks: int,
                 sharded: bool) -> float:
    """Seconds a micro-batch spends sampling (at max_new_tokens: a run whose completions end sooner is faster)."""
    g = cfg.grpo
    read = (weight_bytes(cfg, n_params) + kv_cache_bytes(cfg, s) / 2) / (hbm_gbps * GB * HBM_SHARE)
    per_token = max(read, s.layers * DECODE_LAYER_S)
    if sharded and ranks > 1:
        per_token += weight_bytes(cfg, n_params) * (ranks - 1) / ranks / (link_gbps * GB)
    return g.max_new_tokens * per_token


def notes(cfg: C.RunConfig, s: Shapes) -> list[str]:
    if cfg.train.objective != "grpo":
        return []
    g = cfg.grpo
    rows = cfg.train.micro_batch * g.generations
    out = [f"grpo: a sample is a prompt completed {g.generations} times (micro_batch {cfg.train.micro_batch} = "
           f"{rows} rows of up to data.seq_len {cfg.data.seq_len} tokens a forward); sampling's KV cache "
           f"{C.format_size(kv_cache_bytes(cfg, s))} at its longest, held only while sampling (before the training "
           f"forward): the GPU peak is the larger of the sampling moment and training's"]
    if reference_bytes(cfg, s):
        out.append(f"grpo with beta > 0, fully fine-tuned: a frozen copy of the starting weights, "
                   f"{C.format_size(reference_bytes(cfg, s))} a rank (counted at every moment), one more forward "
                   "without grad a micro-batch")
    if g.beta and cfg.adapters:
        out.append("grpo with beta > 0: the reference is the base with the adapters off, one more forward without "
                   "grad a micro-batch")
    return out
