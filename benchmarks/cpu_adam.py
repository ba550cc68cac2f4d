"""Time one AdamW step on the CPU over N parameters, as an offloaded optimizer runs it: torch's fused
and foreach AdamW, and DeepSpeed's CPUAdam (AVX + OpenMP, fp32 or bf16 moments), and the bf16 update with
stochastic or Kahan rounding (backends/optim/master_update.py), compiled and eager.

    python3 benchmarks/cpu_adam.py --params 500e6 --tensors 64
    python3 benchmarks/cpu_adam.py --params 1e8 --torch-only --only-rounded    # issue 35: the rounded host step

Prints seconds per step and host bytes per parameter for each; --out writes JSON."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def make(n: int, k: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    per = n // k
    ps = []
    for _ in range(k):
        p = torch.nn.Parameter(torch.randn(per, dtype=dtype) * 0.02)
        p.grad = torch.randn(per, dtype=dtype) * 1e-3
        ps.append(p)
    return ps


def time_steps(opt, steps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of all threads) a step. The CPU seconds hold on a shared machine,
    where the wall time is mostly the neighbours' load: bytes / CPU-second is a core's bandwidth."""
    opt.step()   # states allocated (and the rounded update compiled) on the first step
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=200e6)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--torch-only", action="store_true", help="skip DeepSpeed's CPUAdam (no op build)")
    ap.add_argument("--eager", action="store_true", help="also the rounded update unfused (slow)")
    ap.add_argument("--skip", nargs="*", default=[], help="case names to leave out")
    ap.add_argument("--only-rounded", action="store_true", help="only torch's fused bf16 and the rounded update")
    a = ap.parse_args()
    n = int(a.params)
    rows = []
    cases = [("torch fused fp32", torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
             ("torch foreach fp32", torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)),
             ("torch fused bf16", torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))]
    from shardconsole.backends.optim.master_update import RoundedAdamW
    for rounding in ("stochastic", "kahan"):
        # "c++ op": backends/optim/rounded_update_cpu.py (what an offloaded run's host step runs); "inductor": the
        # update compiled by torch.compile, as before it (issue 35 item 2)
        for how in ("c++ op", "inductor", "eager") if a.eager else ("c++ op", "inductor"):
            cases.append((f"rounded {rounding} bf16 {how}", torch.bfloat16,
                          lambda ps, r=rounding, h=how: RoundedAdamW(ps, lr=1e-4, rounding=r, compile=h != "eager",
                                                                     host_op=h == "c++ op")))
    try:
        if a.torch_only:
            raise ImportError("--torch-only")
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        cases += [("deepspeed cpuadam fp32", torch.float32, lambda ps: DeepSpeedCPUAdam(ps, lr=1e-4)),
                  ("deepspeed cpuadam bf16", torch.bfloat16,
                   lambda ps: DeepSpeedCPUAdam(ps, lr=1e-4, fp32_optimizer_states=False))]
    except Exception as e:   # noqa: BLE001 - report and go on with torch's
        print(f"DeepSpeedCPUAdam unavailable: {e}")
    for name, dtype, mk in cases:
        if name in a.skip or (a.only_rounded and not name.startswith(("rounded", "torch fused bf16"))):
            continue
        ps = make(n, a.tensors, dtype)
        try:
            s, cpu_s = time_steps(mk(ps), a.steps)
        except Exception as e:   # noqa: BLE001
            rows.append({"name": name, "error": str(e)[:200]})
            continue
        # Bytes the step must move a parameter (read weight, gradient, two moments; write weight and moments):
        # fp32 28, bf16 14, +4 for the Kahan buffer (read and written).
        moved = (28 if dtype == torch.float32 else 14) + (4 if "kahan" in name else 0)
        rows.append({"name": name, "s_per_step": s, "gparams_per_s": n / s / 1e9, "bytes_per_param": moved,
                     "gbps": n * moved / s / 1e9, "cpu_s_per_step": cpu_s, "gb_per_cpu_s": n * moved / cpu_s / 1e9})
        del ps
    print(f"{n / 1e6:.0f}M params, {a.tensors} tensors, {torch.get_num_threads()} threads, {os.cpu_count()} cpus")
    for r in rows:
        print(f"{r['name']:<30} " + (f"{r['s_per_step']:.3f} s/step  {r['gparams_per_s']:.2f} Gparam/s  "
                                     f"{r['gbps']:.1f} GB/s moved  ({r['gb_per_cpu_s']:.1f} GB a CPU-second)"
                                     if "s_per_step" in r else r["error"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"params": n, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
