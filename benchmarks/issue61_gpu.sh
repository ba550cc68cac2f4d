#!/usr/bin/env bash
# Issue 61 on the GPU machine: GRPO under the presets' 24 GiB cap, `plan --json` beside each run (gpu_runs.py
# matrix issue61-grpo). Run from the repo root after the wheelhouse line:
#     bash benchmarks/issue61_gpu.sh      # four rows, about 8 minutes (ONLY="NAME ..." for some)
# Writes $OUT/issue61.json (gpu_runs.py's rows) and .log.
set -u
OUTD=${OUT:-/tmp/issue61_out}
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_RUNS_ROOT=/tmp/sc-61-runs SHARDCONSOLE_SPEEDS_FILE=/tmp/sc-61-speeds.jsonl
python3 - <<'PY'
import json, random
rng = random.Random(0)
with open("/tmp/sc-61-prompts.jsonl", "w") as f:
    for i in range(512):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        f.write(json.dumps({"prompt": f"Q: what is {a} + {b}? A:", "answer": str(a + b)}) + "\n")
PY
cat > /tmp/sc-61-rewards.py <<'PY'
def score(prompts, completions, answer, **kwargs):
    """1 for the sum, 0.2 for a completion with a digit in its first 8 characters, else 0."""
    return [1.0 if a in c else 0.2 if any(ch.isdigit() for ch in c[:8]) else 0.0 for c, a in zip(completions, answer)]
PY
python3 benchmarks/gpu_runs.py --matrix issue61-grpo --timeout 300 --plan --out "$OUTD/issue61.json" ${ONLY:+--only $ONLY} 2>&1 \
  | grep -v '^{' | tee "$OUTD/issue61.log"
python3 benchmarks/gpu_runs.py --against-plan "$OUTD/issue61.json" | tee -a "$OUTD/issue61.log"
for log in /tmp/sc-bench-*/*/logs/rank0.log; do
  grep -q Traceback "$log" && { echo "== $log"; grep -B2 -A30 Traceback "$log" | tail -40; } | tee -a "$OUTD/issue61.log"
done
rm -rf /tmp/sc-61-runs /tmp/sc-bench-*
