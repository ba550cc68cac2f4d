#!/usr/bin/env bash
# Issue 33: 7B full fine-tuning with offload (3090-7b-offload) beside LoRA (3090-7b-lora) and QLoRA
# (3090-7b-qlora), one H200 capped at 24 GiB by the presets: tokens/s, GPU (allocator and NVML) and host
# peaks, and the held-out loss after the same 12 steps of the same text from the same random base.
# About 6 minutes. Run from the repo root on the GPU machine after the wheelhouse line (PYTHONPATH set;
# the wheels must include peft and its needs, and bitsandbytes for the QLoRA run):
#     bash benchmarks/lora_7b_gpu.sh
# Writes $OUT/lora_7b.json (gpu_runs.py's rows, eval_loss included) and $OUT/lora_7b.log (its table: gpu_runs.py --markdown).
#     bash benchmarks/lora_7b_gpu.sh cal
# The LoRA planner's calibration instead (matrix issue33cal, about 7 minutes): 7B LoRA, 7B QLoRA (also with
# lora.dropout 0.05) and 13B QLoRA under the cap, each run's measured peaks beside `plan --json`'s, and
# QLoRA's build peak (its rank0.log line) apart from its training peak. Writes $OUT/lora_cal.json / .log.
set -u
MODE=${1:-table}
OUTD=${OUT:-/tmp/lora_out}
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_RUNS_ROOT=/tmp/sc-lora-runs SHARDCONSOLE_SPEEDS_FILE=/tmp/sc-lora-speeds.jsonl
python3 -c "import bitsandbytes, peft; print('bitsandbytes', bitsandbytes.__version__, 'peft', peft.__version__)" \
    || echo "bitsandbytes or peft missing: the QLoRA (or every adapter) run will be refused in one line"
# The text: 2 MB of numbered sentences, read as UTF-8 bytes by the catalog model (no tokenizer); 2% held out.
python3 benchmarks/sample_text.py /tmp/sc-lora-text.jsonl
if [ "$MODE" = cal ]; then
    python3 benchmarks/gpu_runs.py --matrix issue33cal --plan --timeout 300 --out "$OUTD/lora_cal.json" 2>&1 \
        | tee "$OUTD/lora_cal.log"
    python3 - "$OUTD/lora_cal.json" <<'PY' | tee -a "$OUTD/lora_cal.log"
import json, re, sys
rows = json.load(open(sys.argv[1]))["results"]
f = lambda v: "-" if v is None else f"{v:.2f}"
err = lambda p, m: "-" if p is None or not m else f"{100 * (p / m - 1):+.0f}%"
print("\n| run | rc | build peak alloc GiB | train peak alloc / reserved / NVML GiB | plan alloc / reserved / NVML GiB"
      " | plan err alloc / reserved / NVML |")
print("|---|---|---|---|---|---|")
for r in rows:
    build = next((m.group(1) for line in r.get("rank_log", []) if (m := re.search(r"build peak ([\d.]+) GiB", line))), "-")
    meas = (r.get("peak_allocated_gib"), r.get("peak_reserved_gib"), r.get("nvml_used_gib"))
    plan = (r.get("plan_allocated_gib"), r.get("plan_reserved_gib"), r.get("plan_nvml_gib"))
    print(f"| {r['name']} | {r['rc']} | {build} | {' / '.join(map(f, meas))} | {' / '.join(map(f, plan))} | "
          f"{' / '.join(err(p, m) for p, m in zip(plan, meas))} |")
for r in rows:
    print(r["name"], r.get("plan_phase"), r.get("plan_parts_gib"), r.get("failed") or "", r.get("plan_error", ""))
PY
    exit 0
fi
python3 benchmarks/gpu_runs.py --matrix issue33 --timeout 420 --out "$OUTD/lora_7b.json" 2>&1 | tee "$OUTD/lora_7b.log"
{ echo; python3 benchmarks/gpu_runs.py --markdown "$OUTD/lora_7b.json"; } | tee -a "$OUTD/lora_7b.log"
