"""What keeping packed documents apart costs: tokens/s of forward + backward of CausalLMLoss on packed
windows, with data.cross_document_attention = true (positions 0..S-1, plain causal attention) and false
(positions restart per document: transformers builds a block-diagonal causal mask, and SDPA runs with an
explicit mask instead of its is_causal fast path).

    python benchmarks/packing_attention.py --model tiny --seq-len 512 --micro-batch 4
    python benchmarks/packing_attention.py --model 125m --seq-len 2048 --device cuda --dtype bf16

Documents have lengths drawn from a geometric distribution (--mean-doc tokens). Prints one line per
mode and the ratio; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from shardconsole.backends.data.corpus import DOC_START, LOSS
from shardconsole.backends.data.batches import windows_to_batch
from shardconsole.backends.model.modeling import CausalLMLoss
from shardconsole.settings.models import CATALOG


def packed_windows(batch: int, seq_len: int, vocab: int, mean_doc: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (batch, seq_len + 1))
    flags = np.full(ids.shape, LOSS, dtype=np.uint8)
    for row in flags:
        i = 0
        while i < seq_len + 1:
            row[i] = DOC_START
            i += int(rng.geometric(1 / mean_doc))
    return ids, flags


def measure(model, batch, steps: int, device) -> float:
    b = batch.to(device)

    def one():
        loss = model(b.inputs, b.labels, b.positions)
        loss.backward()
    for _ in range(2):
        one()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * b.inputs.numel() / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(CATALOG))
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--mean-doc", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig
    device = torch.device(args.device)
    hf = LlamaConfig(**CATALOG[args.model], use_cache=False)
    hf._attn_implementation = args.attn
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(hf, attn_implementation=args.attn)
    model = CausalLMLoss(lm).to(device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    ids, flags = packed_windows(args.micro_batch, args.seq_len, hf.vocab_size, args.mean_doc, seed=0)
    result = {"args": vars(args), "threads": torch.get_num_threads(),
              "docs_per_window": float((flags[:, :-1] & DOC_START).astype(bool).sum(1).mean())}
    for cross in (True, False):
        tps = measure(model, windows_to_batch(ids, flags, cross_doc=cross), args.steps, device)
        result["cross_document" if cross else "per_document"] = round(tps, 1)
        print(f"cross_document_attention={str(cross).lower():5s}  {tps:10.1f} tokens/s")
    ratio = result["per_document"] / result["cross_document"]
    result["per_document_over_cross"] = round(ratio, 3)
    print(f"per-document / cross-document: {ratio:.3f} ({(1 - ratio) * 100:+.1f}% cost), "
          f"{result['docs_per_window']:.1f} documents per window")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
