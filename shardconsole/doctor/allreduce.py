"""One rank of the doctor's all-reduce check: `python -m shardconsole.doctor.allreduce --rank R --world W
--port P`. The doctor starts W of these on the GPUs of this machine, once with NCCL's peer-to-peer path and
once with NCCL_P2P_DISABLE=1, and kills them when they do not answer in time: a broken P2P path (two
consumer cards behind a PCIe switch or IOMMU that drops peer traffic) hangs or returns wrong sums.

Rank 0 prints one JSON line: {"ok": bool, "seconds": a timed all-reduce, "busbw_gbps": ..., "error": ...}.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

SIZE_BYTES = 64 << 20
ITERS = 5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    out: dict = {"ok": False}
    try:
        import torch
        import torch.distributed as dist
        dev = torch.device("cuda", args.rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world, timeout=timedelta(seconds=60), device_id=dev)
        check = torch.full((1024,), float(args.rank + 1), device=dev)
        dist.all_reduce(check)
        want = args.world * (args.world + 1) / 2
        buf = torch.ones(SIZE_BYTES // 4, device=dev)
        dist.all_reduce(buf)                  # warm-up: NCCL sets up its channels on the first call
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(ITERS):
            dist.all_reduce(buf)
        torch.cuda.synchronize(dev)
        seconds = (time.perf_counter() - t0) / ITERS
        got = float(check[0].item())
        algbw = SIZE_BYTES / seconds
        out = {"ok": got == want, "seconds": seconds,
               "busbw_gbps": algbw * 2 * (args.world - 1) / args.world / 1e9,
               "error": "" if got == want else f"wrong sum: {got} (expected {want})"}
        dist.destroy_process_group()
    except Exception as e:   # noqa: BLE001 - the doctor reports it
        out = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    if args.rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
