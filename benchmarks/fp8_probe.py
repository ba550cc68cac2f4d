"""Issue 48, first look (GPU): what FP8 linears (torchao float8 training, tensorwise and rowwise) and a fused
linear cross-entropy (liger-kernel) buy on the shapes of the 24 GB recipes, before any of it is wired into
the engines. Bare: a few Hugging Face Llama decoder layers of the 7B's shapes (hidden 4096, 11008, 32 heads)
compiled one by one, bf16 weights, a micro-batch of the preset's tokens; and the head + loss at vocab 32000.

    python3 benchmarks/fp8_probe.py --layers 4 --mb 6 --seq 2048 --out $OUT/fp8_probe.json

Prints ms a forward+backward of the layers per variant (median of --iters after --warmup): bf16, torchao
float8 tensorwise and rowwise (compiled), and bf16 eager beside liger-kernel's RMSNorm / SwiGLU / RoPE
(eager and compiled: whether liger's fused kernels beat what inductor fuses); and for the loss: ms and
peak memory of torch's cross-entropy on whole logits against liger's fused linear cross-entropy, and
their loss and gradient differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _layers(n: int, hidden: int, inter: int, heads: int) -> torch.nn.ModuleList:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=heads, num_hidden_layers=n, vocab_size=32000)
    cfg._attn_implementation = "sdpa"
    return torch.nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(n)), cfg


def _time(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1000


def layers_ms(variant: str, args: argparse.Namespace) -> float:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    if variant.startswith("liger"):
        # liger's RMSNorm, SwiGLU MLP and RoPE patched into transformers' Llama (process-wide: run last)
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    torch.manual_seed(0)
    layers, cfg = _layers(args.layers, 4096, 11008, 32)
    layers = layers.cuda().to(torch.bfloat16)
    if variant in ("tensorwise", "rowwise"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        fcfg = Float8LinearConfig.from_recipe_name(variant)
        for layer in layers:
            convert_to_float8_training(layer, config=fcfg)
    compiled = list(layers) if variant.endswith("-eager") else [torch.compile(layer) for layer in layers]
    rope = LlamaRotaryEmbedding(cfg).cuda()
    x0 = torch.randn(args.mb, args.seq, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(args.seq, device="cuda").unsqueeze(0)
    emb = rope(x0, pos)

    def step() -> None:
        h = x0
        for layer in compiled:
            out = layer(h, position_embeddings=emb, attention_mask=None)
            h = out[0] if isinstance(out, tuple) else out
        h.float().pow(2).mean().backward()
        for p in layers.parameters():
            p.grad = None
    return _time(step, args.warmup, args.iters)


def loss_probe(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    n = args.mb * args.seq
    h = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16) * 0.5
    w = (torch.randn(32000, 4096, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    y = torch.randint(0, 32000, (n,), device="cuda")
    out = {}

    def torch_ce() -> torch.Tensor:
        hh = h.detach().requires_grad_()
        loss = torch.nn.functional.cross_entropy((hh @ w.t()).float(), y)
        loss.backward()
        return loss

    variants = {"torch whole logits": torch_ce}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        flce = LigerFusedLinearCrossEntropyLoss()

        def liger_ce() -> torch.Tensor:
            hh = h.detach().requires_grad_()
            loss = flce(w, hh, y)
            loss.backward()
            return loss
        variants["liger fused linear"] = liger_ce
    except ImportError as e:
        out["liger"] = f"not installed: {e}"
    ref = None
    for name, fn in variants.items():
        w.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        grad = w.grad.detach().float().clone()
        ms = _time(lambda: (setattr(w, "grad", None), fn()), args.warmup, args.iters)
        row = {"ms": round(ms, 2), "peak_extra_gib": round(peak, 3), "loss": float(loss)}
        if ref is None:
            ref = (float(loss), grad)
        else:
            row["loss_diff"] = abs(float(loss) - ref[0])
            row["grad_rel_diff"] = float((grad - ref[1]).norm() / ref[1].norm())
        out[name] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mb", type=int, default=6)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res: dict = {"args": vars(args), "gpu": torch.cuda.get_device_name(), "layers_ms": {}}
    # liger's kernels last: its patch of transformers' Llama classes cannot be undone in the process
    for variant in ("bf16", "tensorwise", "rowwise", "bf16-eager", "liger-eager", "liger"):
        try:
            res["layers_ms"][variant] = round(layers_ms(variant, args), 2)
        except Exception as e:      # a recipe this torch/torchao cannot run: say so, go on
            res["layers_ms"][variant] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        print(variant, res["layers_ms"][variant], flush=True)
        torch.cuda.empty_cache()
    res["loss"] = loss_probe(args)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
