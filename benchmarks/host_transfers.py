"""What an offloaded step moves and casts on this machine: the host's memory bandwidth alone (copy, sum,
triad over all cores), pinned host <-> GPU copy rates in fp32 and bf16, and the host-side fp32 -> bf16
cast that fsdp.offload_compute_copy adds after each step.

    python3 benchmarks/host_transfers.py --gib 4 --out $OUT/host_transfers.json

Prints GB/s for each (a GPU is needed for the copies; the cast runs anywhere)."""

from __future__ import annotations

import argparse
import json
import time

import torch


def rate(fn, nbytes: int, reps: int, sync) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0, help="fp32 data per copy")
    ap.add_argument("--tensors", type=int, default=64, help="the data split in this many tensors (shards)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n = int(args.gib * 2**30 / 4)
    per = n // args.tensors
    out: dict = {"fp32_gib": args.gib, "tensors": args.tensors, "threads": torch.get_num_threads()}
    # The host's memory bandwidth alone (issue 17 item 3: the bar for the offloaded optimizer step):
    # a copy reads and writes each byte (counted twice), a sum only reads, a triad reads two and writes one.
    big_a, big_b = torch.empty(n), torch.empty(n)
    big_a.fill_(1.0)
    big_b.fill_(2.0)
    out["host_copy_gbps_read_plus_write"] = rate(lambda: big_b.copy_(big_a), 2 * n * 4, args.reps, lambda: None)
    out["host_sum_gbps_read"] = rate(lambda: big_a.sum(), n * 4, args.reps, lambda: None)
    out["host_triad_gbps"] = rate(lambda: torch.add(big_a, big_b, alpha=0.5, out=big_a), 3 * n * 4, args.reps,
                                  lambda: None)
    del big_a, big_b
    masters = [torch.randn(per) for _ in range(args.tensors)]
    copies = [torch.empty(per, dtype=torch.bfloat16) for _ in range(args.tensors)]
    out["host_cast_fp32_to_bf16_gbps_read"] = rate(lambda: torch._foreach_copy_(copies, masters), n * 4, args.reps,
                                                   lambda: None)
    if torch.cuda.is_available():
        from torch.cuda import _pin_memory_utils
        for t in masters + copies:
            _pin_memory_utils.pin_memory(t.data_ptr(), t.numel() * t.element_size())
        dev = torch.device("cuda")
        sync = torch.cuda.synchronize
        for name, src in (("fp32", masters), ("bf16", copies)):
            nbytes = n * src[0].element_size()
            gpu = [torch.empty_like(t, device=dev) for t in src]
            out[f"h2d_{name}_gbps"] = rate(lambda: [g.copy_(s, non_blocking=True) for g, s in zip(gpu, src)],
                                           nbytes, args.reps, sync)
            out[f"d2h_{name}_gbps"] = rate(lambda: [s.copy_(g, non_blocking=True) for g, s in zip(gpu, src)],
                                           nbytes, args.reps, sync)
            # Both directions at once, on two streams, as backward does (gradients out, parameters in).
            s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
            half = len(src) // 2

            def both():
                with torch.cuda.stream(s1):
                    for g, s in zip(gpu[:half], src[:half]):
                        g.copy_(s, non_blocking=True)
                with torch.cuda.stream(s2):
                    for g, s in zip(gpu[half:], src[half:]):
                        s.copy_(g, non_blocking=True)
            out[f"bidir_{name}_gbps"] = rate(both, nbytes, args.reps, sync)
            del gpu
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    for k, v in out.items():
        print(f"{k:<36} {v:.2f}" if isinstance(v, float) else f"{k:<36} {v}")


if __name__ == "__main__":
    main()
