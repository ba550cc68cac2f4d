#!/usr/bin/env bash
# Issue 16 (T): `shardconsole tune` of 3090-7b-offload under a 24 GiB cap on the H200, the built-in preset
# probed first as the baseline, then the options the planner ranks fastest; about 3.5 minutes.
# Run from the repo root on the GPU machine after COMMON.md's wheel line (PYTHONPATH set):
#     bash benchmarks/tune_7b_gpu.sh
# Writes $OUT/t_tune7b.log (the live table and the winner) and $OUT/t_tune7b.tgz (the code version, the
# speed book, the written preset and each probe's metrics.jsonl). tune is stopped with SIGINT at its limit,
# so the probe in flight is stopped through the normal stop path (no rank outlives the script).
# T_PRESET / T_CAP / T_BUDGET / T_LIMIT (seconds before SIGINT, default 240) change what is tuned (a CPU smoke test: T_PRESET=tiny-cpu T_CAP=).
set -u
OUTD=${OUT:-/tmp/t_out}
PRESET=${T_PRESET:-3090-7b-offload}
CAP=${T_CAP-24GiB}
BUDGET=${T_BUDGET:-190s}
W=/tmp/t_tune
rm -rf "$W" && mkdir -p "$W" "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_SPEEDS_FILE=$W/speeds.jsonl SHARDCONSOLE_PRESETS_DIR=$W/presets \
    SHARDCONSOLE_RUNS_ROOT=$W/runs
python3 -c "from shardconsole.plan.calibration import code_version; import json; print(json.dumps(code_version()))" \
    > "$W/code_version.json"
timeout -s INT "${T_LIMIT:-240}" python3 -m shardconsole tune --preset "$PRESET" ${CAP:+--gpu-memory "$CAP"} --max-probes 3 \
    --probe-steps 4 --budget "$BUDGET" -o "$PRESET-tuned" 2>&1 | tee "$W/tune7b.log"
for f in "$W"/runs/*/probe-*/metrics.jsonl; do
    [ -f "$f" ] && cp "$f" "$W/$(basename "$(dirname "$f")").metrics.jsonl"
done
mkdir -p "$W/presets"
(cd "$W" && tar czf "$OUTD/t_tune7b.tgz" code_version.json tune7b.log presets $(ls speeds.jsonl probe-*.metrics.jsonl 2>/dev/null))
cp "$W/tune7b.log" "$OUTD/t_tune7b.log"
