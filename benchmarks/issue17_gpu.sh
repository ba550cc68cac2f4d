#!/bin/bash
# Issue 17 on the GPU machine, in one call: the host's memory bandwidth alone and the host optimizer step
# against it, the README's 125m 500-step curve under each master rounding (run together), then the 24 GiB
# targets on the host arena. Results in $OUT (copy them to benchmarks/results/).
set -u
OUT=${OUT:-/tmp/issue17}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g; } > "$OUT/machine.txt" 2>&1
python3 benchmarks/host_transfers.py --gib 4 --out "$OUT/host_transfers.json" 2>&1 | tail -12
python3 benchmarks/cpu_adam.py --params 3e8 --tensors 32 --steps 2 --torch-only --skip "torch foreach fp32" \
    --out "$OUT/cpu_adam.json" 2>&1 | tail -8
python3 benchmarks/gpu_runs.py --matrix issue17-curves --parallel --timeout 300 --out "$OUT/curves.json" 2>&1 | tail -6
python3 benchmarks/gpu_runs.py --matrix issue17-big ${BIG_ONLY:+--only $BIG_ONLY} --timeout 240 \
    --out "$OUT/big.json" 2>&1 | tail -6
