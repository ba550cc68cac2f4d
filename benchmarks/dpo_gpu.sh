#!/usr/bin/env bash
# Issue 47: 7B DPO beside SFT on one H200 capped at 24 GiB by the presets, seq 1024: full fine-tuning on the
# 7B offload recipe (3090-7b-offload) and LoRA on 3090-7b-lora, each DPO run beside an SFT run of the same
# preset and the same sequences a step (gpu_runs.py's matrix issue47). Reports tokens/s (a pair's two rows
# both counted), DPO/SFT, GPU and host peaks, and full DPO's reference pass on its own (before step 1).
# Needs the engines to call the objective (backends/objective/preference.py: make, prepare, micro_loss,
# figures); about 10 minutes (four 7B builds). Run from the repo root on the GPU machine after the wheelhouse
# line (../shared/gpu/wheelhouse.sh; PYTHONPATH set):
#     bash benchmarks/dpo_gpu.sh
# Writes $OUT/dpo_7b.json (gpu_runs.py's rows) and $OUT/dpo_7b.log (the table and the ratios).
set -u
OUTD=${OUT:-/tmp/dpo_out}
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_RUNS_ROOT=/tmp/sc-dpo-runs SHARDCONSOLE_SPEEDS_FILE=/tmp/sc-dpo-speeds.jsonl
python3 benchmarks/sample_pairs.py /tmp/sc-dpo-pairs.jsonl /tmp/sc-dpo-sft.jsonl 240
python3 benchmarks/gpu_runs.py --matrix issue47 --timeout 420 --out "$OUTD/dpo_7b.json" 2>&1 | tee "$OUTD/dpo_7b.log"
{ echo; python3 benchmarks/gpu_runs.py --markdown "$OUTD/dpo_7b.json"; } | tee -a "$OUTD/dpo_7b.log"
python3 - "$OUTD/dpo_7b.json" <<'PY' | tee -a "$OUTD/dpo_7b.log"
import json, sys
rows = {r["name"]: r for r in json.load(open(sys.argv[1]))["results"]}
for kind in ("offload", "lora"):
    sft, dpo = rows.get(f"7b-{kind}-sft", {}), rows.get(f"7b-{kind}-dpo", {})
    a, b = sft.get("tokens_per_s"), dpo.get("tokens_per_s")
    ratio = f"{b / a:.2f}x" if a and b else "n/a"
    ref = dpo.get("reference_s")
    print(f"7b {kind}: SFT {a or 0:,.0f} tokens/s, DPO {b or 0:,.0f} tokens/s ({ratio} of SFT; the issue's bar for "
          f"full DPO is 0.9x)" + (f"; reference pass {ref:.1f} s before step 1, cached" if ref is not None else ""))
PY
