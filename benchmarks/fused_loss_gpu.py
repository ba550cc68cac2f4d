"""Issue 48 item 2 (GPU): the head + next-token loss three ways, on the shapes of the 24 GB recipes: the chunked
loss (modeling.chunked_cross_entropy: 4096 tokens' logits at a time, recomputed in backward), our fused one
(fused_loss.py's torch kernel) and liger-kernel's (when it imports; pip install 'shardconsole[fused]').

    python3 benchmarks/fused_loss_gpu.py --out $OUT/fused_loss.json

For each vocabulary (default 32000 and 128256; hidden 4096, 12,288 tokens = micro-batch 6 x 2048, bf16, 5% of
the labels -100): ms of forward + backward (CUDA events, median of --repeat after --warmup), the peak memory
allocated beyond the inputs (max_memory_allocated minus what was allocated before; the gradients it returns
count), and the largest difference of the loss and of both gradients from an fp32 reference on whole logits,
relative to the reference's largest magnitude. Prints a table, writes the JSON to --out. `--device cpu` with
small sizes runs the same code anywhere (tests/test_fused_loss.py does, as a smoke test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # the checkout's shardconsole, not an install
from shardconsole.backends.model import fused_loss  # noqa: E402
from shardconsole.backends.model.modeling import chunked_cross_entropy  # noqa: E402

GiB = 2**30
Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def variants(device: torch.device) -> dict[str, Loss]:
    out: dict[str, Loss] = {
        "chunked": lambda h, w, y: chunked_cross_entropy(h, w, y),
        "torch-fused": lambda h, w, y: fused_loss.fused_linear_cross_entropy(h, w, y, kernel="torch"),
    }
    if fused_loss.kernel_for(device) == "liger":
        out["liger"] = lambda h, w, y: fused_loss.fused_linear_cross_entropy(h, w, y, kernel="liger")
    return out


def inputs(tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g) * 0.5).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, dtype)
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[torch.rand(tokens, generator=g) < 0.05] = -100
    return h, w, y.to(device)


def run_once(fn: Loss, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(hh, ww, y)
    loss.backward()
    return loss.detach(), hh.grad, ww.grad


def reference(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
    """fp32 on whole logits: the numbers every variant is held to."""
    return run_once(lambda hh, ww, yy: F.cross_entropy(hh @ ww.t(), yy, ignore_index=-100), h.float(), w.float(), y)


def timed_ms(fn: Loss, h, w, y, device: torch.device, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        run_once(fn, h, w, y)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_once(fn, h, w, y)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run_once(fn, h, w, y)
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def peak_gib(fn: Loss, h, w, y, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = run_once(fn, h, w, y)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return peak / GiB


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def measure(vocab: int, args: argparse.Namespace, device: torch.device) -> list[dict]:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    h, w, y = inputs(args.tokens, vocab, args.hidden, dtype, device)
    ref = reference(h, w, y)
    ref = tuple(t.cpu() for t in ref)       # off the device: the peaks below are the variants' own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows = []
    for name, fn in variants(device).items():
        peak = peak_gib(fn, h, w, y, device)
        loss, gh, gw = (t.cpu() for t in run_once(fn, h, w, y))
        rows.append({"vocab": vocab, "hidden": args.hidden, "tokens": args.tokens, "dtype": args.dtype,
                     "kernel": name, "ms": round(timed_ms(fn, h, w, y, device, args.warmup, args.repeat), 3),
                     "peak_extra_gib": None if peak is None else round(peak, 3),
                     "loss": float(loss), "loss_rel_diff": rel(loss, ref[0]),
                     "grad_hidden_rel_diff": rel(gh, ref[1]), "grad_weight_rel_diff": rel(gw, ref[2])})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=6 * 2048)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = [r for v in args.vocab for r in measure(v, args, device)]
    head = f"{'vocab':>7} {'kernel':<12} {'ms':>9} {'peak GiB':>9} {'loss':>9} {'d loss':>9} {'d hidden':>9} {'d weight':>9}"
    print(head)
    for r in rows:
        peak = "-" if r["peak_extra_gib"] is None else f"{r['peak_extra_gib']:.3f}"
        print(f"{r['vocab']:>7} {r['kernel']:<12} {r['ms']:>9.2f} {peak:>9} {r['loss']:>9.4f} "
              f"{r['loss_rel_diff']:>9.2e} {r['grad_hidden_rel_diff']:>9.2e} {r['grad_weight_rel_diff']:>9.2e}")
    doc = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
