#!/usr/bin/env bash
# Issue 62 on the GPU machine: llama3-8b at long context under the presets' 24 GiB cap, with `plan --json`
# beside each run (gpu_runs.py matrix issue62-long). Run from the repo root after the wheelhouse line:
#     bash benchmarks/issue62_gpu.sh      # the three, about 8 minutes (ONLY="NAME ..." for some)
#     MATRIX=issue62-second bash benchmarks/issue62_gpu.sh   # LoRA 32k with the base offloaded, QLoRA 64k 10 steps
# Writes $OUT/issue62.json (gpu_runs.py's rows) and .log.
set -u
OUTD=${OUT:-/tmp/issue62_out}
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_RUNS_ROOT=/tmp/sc-62-runs SHARDCONSOLE_SPEEDS_FILE=/tmp/sc-62-speeds.jsonl
python3 benchmarks/gpu_runs.py --matrix "${MATRIX:-issue62-long}" --timeout 420 --plan --out "$OUTD/issue62.json" ${ONLY:+--only $ONLY} 2>&1 \
  | grep -v '^{' | tee "$OUTD/issue62.log"
python3 benchmarks/gpu_runs.py --against-plan "$OUTD/issue62.json" | tee -a "$OUTD/issue62.log"
for log in /tmp/sc-bench-*/*/logs/rank0.log; do
  grep -q Traceback "$log" && { echo "== $log"; grep -B2 -A30 Traceback "$log" | tail -40; } | tee -a "$OUTD/issue62.log"
done
rm -rf /tmp/sc-62-runs /tmp/sc-bench-*
