#!/usr/bin/env bash
# Issue 59 on the GPU machine, one device call: a Llama-3.1-8B-shaped folder with random bf16 weights drawn
# on the GPU (benchmarks/model_folder.py), then 3090-7b-lora, 3090-7b-qlora and 3090-7b-offload run on it as a
# user would (--set model.name=FOLDER, H200 capped at 24 GiB by the presets), with `plan --json` beside each
# and the unchanged 7B LoRA preset in the same call. Run from the repo root after the wheelhouse line.
# Writes $OUT/issue59_8b.json (gpu_runs.py's rows) and .log.
set -u
OUTD=${OUT:-/tmp/issue59_out}
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_RUNS_ROOT=/tmp/sc-59-runs SHARDCONSOLE_SPEEDS_FILE=/tmp/sc-59-speeds.jsonl
python3 benchmarks/model_folder.py llama3-8b /tmp/sc-llama3-8b 2>&1 | tail -1 | tee "$OUTD/issue59_8b.log"
python3 benchmarks/gpu_runs.py --matrix issue59-8b --timeout 240 --plan --out "$OUTD/issue59_8b.json" ${ONLY:+--only $ONLY} 2>&1 \
  | grep -v '^{' | tee -a "$OUTD/issue59_8b.log"
python3 benchmarks/gpu_runs.py --against-plan "$OUTD/issue59_8b.json" | tee -a "$OUTD/issue59_8b.log"
for log in /tmp/sc-bench-*/*/logs/rank0.log; do     # a failed run's own words, for the log that comes back
  grep -q Traceback "$log" && { echo "== $log"; grep -A40 Traceback "$log" | tail -40; } | tee -a "$OUTD/issue59_8b.log"
done
rm -rf /tmp/sc-59-runs /tmp/sc-llama3-8b /tmp/sc-bench-*
