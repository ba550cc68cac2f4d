#!/usr/bin/env bash
# Issue 35 item 4, one GPU call (about 6-8 minutes): on one H200 capped at 24 GiB, 3b on torchao's 8-bit
# AdamW without offload (the ordinary step, then optim.step_in_backward), the torchtune-style bare loop
# (benchmarks/bare_loops.py: 8-bit AdamW + step in backward + checkpointing, bf16) and the 3b offload
# recipe, the same text, held-out records, micro-batch, steps and constant lr: tokens/s, NVML's peak, the
# held-out loss after the last step. Run from the repo root on the GPU machine (PYTHONPATH set, torchao
# installed):
#     bash benchmarks/issue35_gpu.sh
# Writes $OUT/issue35.json (gpu_runs.py's rows) and $OUT/issue35.log (its table: gpu_runs.py --markdown).
# The matrix's other rows (the offload overlap's) are run by their own command.
set -u
OUTD=${OUT:-/tmp/issue35_out}
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_RUNS_ROOT=/tmp/sc-i35-runs SHARDCONSOLE_SPEEDS_FILE=/tmp/sc-i35-speeds.jsonl
python3 -c "import torchao; print('torchao', torchao.__version__)" || echo "torchao missing: the low-bit runs are refused in one line"
# The text lora_7b_gpu.sh writes (the same 6,000 records), read as UTF-8 bytes by the catalog model.
python3 benchmarks/sample_text.py /tmp/sc-lora-text.jsonl
python3 benchmarks/gpu_runs.py --matrix issue35 --timeout 240 --out "$OUTD/issue35.json" \
    --only 3b-adamw8bit-bf16m-step-in-bwd bare-3b-torchtune-adamw8bit-bwd 3b-adamw-offload \
    3b-adamw8bit-bf16m-no-offload 2>&1 | tee "$OUTD/issue35.log"
{ echo; python3 benchmarks/gpu_runs.py --markdown "$OUTD/issue35.json"; } | tee -a "$OUTD/issue35.log"
