#!/usr/bin/env bash
# Issue 60 on the GPU machine (the consumer box's presets), one device call per part. Run from the repo root
# after the wheelhouse line (../shared/gpu/wheelhouse.sh; PYTHONPATH set; .whl carried):
#     bash benchmarks/issue60_gpu.sh 8b    # 3090-8b-64gb (bf16, fp8 at mb 12 and 16) beside 3090-7b-offload on llama3-8b
#     bash benchmarks/issue60_gpu.sh 14b   # 3090-14b-96gb (saved and exported), and with fp8
#     bash benchmarks/issue60_gpu.sh 24b   # 3090-24b-128gb's preflight refusing its save on this disk, then the run
#                                          # with train.save_final=none (and with fp8)
#     bash benchmarks/issue60_gpu.sh final # 24b, 14b (saved) and 8b again, short: one call
#     bash benchmarks/issue60_gpu.sh big   # second session: 24B at mb 6 and at mb 8 with activation offload, 14B saved+exported
#     bash benchmarks/issue60_gpu.sh 8b2   # second session: 8B saved+exported, beside no gradient bound and fp8 at mb 14
#     bash benchmarks/issue60_gpu.sh ft    # held-out loss: a 1b base fine-tuned 40 steps offloaded, fp32-master
#                                          # AdamW and adam-mini, twice each (issue48_gpu.sh ft-numerics' method)
# Every row has `plan --json` beside it; host peak is the run's own sample (the ranks' RSS; the machine's used).
# Writes $OUT/issue60_<part>.json (gpu_runs.py's rows) and .log.
set -u
part=${1:?8b, 14b, 24b, final, big, 8b2 or ft}
OUTD=${OUT:-/tmp/issue60_out}
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_RUNS_ROOT=/tmp/sc-60-runs SHARDCONSOLE_SPEEDS_FILE=/tmp/sc-60-speeds.jsonl
log="$OUTD/issue60_$part.log"
free -g | tee "$log"; df -h /tmp | tail -1 | tee -a "$log"
case "$part" in
  8b|14b|24b|final|big|8b2)
    if [ "$part" = 24b ] || [ "$part" = final ]; then      # the full save does not fit this disk: refused before launch, in one line
      python3 -m shardconsole --preset 3090-24b-128gb --headless --run-dir /tmp/sc-60-runs/refused 2>&1 | tail -3 | tee -a "$log"
    fi
    python3 benchmarks/gpu_runs.py --matrix "issue60-$part" --timeout 420 --plan --out "$OUTD/issue60_$part.json" \
      ${ONLY:+--only $ONLY} 2>&1 | grep -v '^{' | tee -a "$log"
    python3 benchmarks/gpu_runs.py --against-plan "$OUTD/issue60_$part.json" | tee -a "$log"
    ls -la /tmp/sc-60-export-* 2>/dev/null | head -20 | tee -a "$log"
    ;;
  ft)
    python3 benchmarks/sample_text.py /tmp/sc-lora-text.jsonl
    python3 -m shardconsole --preset h200-fsdp --headless --run-dir /tmp/sc-60-runs/base \
      --set data.path=/tmp/sc-lora-text.jsonl --set data.eval_fraction=0.02 --set train.steps=200 \
      --set train.log_every=50 --set train.save_final=none --set train.export_dir=/tmp/sc-48-base 2>&1 | tail -2 | tee -a "$log"
    python3 benchmarks/gpu_runs.py --matrix issue60-ft --timeout 150 --out "$OUTD/issue60_ft.json" 2>&1 \
      | grep -v '^{' | tee -a "$log"
    python3 - "$OUTD/issue60_ft.json" <<'PY' | tee -a "$log"
import json, sys
rows = json.load(open(sys.argv[1]))
rows = rows if isinstance(rows, list) else rows.get("results", [])
for r in rows:
    print(f"{r['name']:<18} eval {r.get('eval_loss')}  last {r.get('last_loss')}  {r.get('tokens_per_s')} tok/s")
PY
    rm -rf /tmp/sc-48-base
    ;;
esac
for log2 in /tmp/sc-bench-*/*/logs/rank0.log /tmp/sc-60-runs/*/logs/rank0.log; do
  [ -f "$log2" ] && grep -q Traceback "$log2" && { echo "== $log2"; grep -B2 -A30 Traceback "$log2" | tail -40; } | tee -a "$log"
done
rm -rf /tmp/sc-60-runs /tmp/sc-bench-* /tmp/sc-60-export-*
