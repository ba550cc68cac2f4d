#!/usr/bin/env bash
# Issue 34: `shardconsole tune` on the H200 under a 24 GiB cap (a 24 GB card, the whole device), twice: the
# 1b preset 3090-offload and the 7B preset 3090-7b-offload. Each must write a winner whose NVML peak, as
# the 24 GB card would show it, is under 24 GiB, at the preset's numerics (dtype, master dtype, rounding).
# Under 10 minutes in all: T1_LIMIT + T2_LIMIT seconds (default 190 + 320) plus two plans and the check (about 9 minutes).
# Run from the repo root on the GPU machine after the wheel line (../shared/gpu/wheelhouse.sh), PYTHONPATH set:
#     bash benchmarks/tune_frontier_gpu.sh
# Writes $OUT/frontier.log (both plans, both live tables, the winners, the check) and $OUT/frontier.tgz (the
# code version, the speed book, the written presets, each probe's metrics.jsonl). Each tune is stopped with
# SIGINT at its limit: the probe in flight stops through the normal stop path and the tune writes the
# fastest finished probe (exit 130), so a winner is kept even when the budget ends mid-probe.
# Exit 0 when both checks pass, 1 otherwise.
set -u
OUTD=${OUT:-/tmp/frontier_out}
W=/tmp/frontier
rm -rf "$W" && mkdir -p "$W" "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_SPEEDS_FILE=$W/speeds.jsonl SHARDCONSOLE_PRESETS_DIR=$W/presets \
    SHARDCONSOLE_RUNS_ROOT=$W/runs
LOG=$W/frontier.log
python3 -c "from shardconsole.plan.calibration import code_version; import json; print(json.dumps(code_version()))" \
    > "$W/code_version.json"
one() {   # preset, SIGINT limit (s), budget, probes, steps
    echo "=== plan $1 --gpu-memory 24GiB" | tee -a "$LOG"
    python3 -m shardconsole plan --preset "$1" --gpu-memory 24GiB 2>&1 | tail -3 | tee -a "$LOG"
    echo "=== tune $1 --gpu-memory 24GiB (limit $2 s)" | tee -a "$LOG"
    timeout -s INT "$2" python3 -m shardconsole tune --preset "$1" --gpu-memory 24GiB --budget "$3" \
        --max-probes "$4" --probe-steps "$5" -o "$1-frontier" 2>&1 | tee -a "$LOG"
    echo "=== tune $1: exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
one 3090-offload "${T1_LIMIT:-190}" "${T1_BUDGET:-160s}" 4 4
one 3090-7b-offload "${T2_LIMIT:-320}" "${T2_BUDGET:-290s}" 2 3
python3 - "$W" <<'PY' 2>&1 | tee -a "$LOG"
# The check: a winner written for each preset, its NVML peak (as on the 24 GB card) under 24 GiB, the
# preset's numerics kept, every probe of the speed book at those numerics.
import json, re, sys, pathlib
from shardconsole.settings import config as C, resolve
w, bad = pathlib.Path(sys.argv[1]), []
for preset in ("3090-offload", "3090-7b-offload"):
    path = w / "presets" / f"{preset}-frontier.toml"
    if not path.is_file():
        bad.append(f"{preset}: no winner written"); continue
    text = path.read_text()
    m = re.search(r"^# winner: (.*?): (\d+) tokens/s, GPU peak ([\d.]+)G", text, re.M)
    won, given = C.load(path), resolve.resolve(preset).cfg
    keys = ("dtype", "master_dtype", "master_rounding")
    same = all(getattr(won.precision, k) == getattr(given.precision, k) for k in keys)
    peak = float(m.group(3)) if m else 99.0
    print(f"{preset}: winner {m.group(1) if m else '?'}, {m.group(2) if m else '?'} tokens/s, NVML peak {peak} GiB "
          f"(as on the 24 GB card) of 24.0; numerics {'kept' if same else 'CHANGED'}")
    if peak >= 24.0: bad.append(f"{preset}: peak {peak} GiB not under the cap")
    if not same: bad.append(f"{preset}: numerics changed")
for line in (w / "speeds.jsonl").read_text().splitlines() if (w / "speeds.jsonl").is_file() else []:
    r = json.loads(line)
    print(f"  probe {r['signature'].get('model')} {r['signature'].get('strategy')} mb {r['signature'].get('micro_batch')} "
          f"{r['signature'].get('master_dtype')} masters: {r['tokens_per_s']:.0f} tokens/s, NVML {r['peaks'].get('gpu', 0) / 2**30:.2f} GiB (raw)")
print("check:", "ok" if not bad else "; ".join(bad))
sys.exit(1 if bad else 0)
PY
rc=${PIPESTATUS[0]}
for f in "$W"/runs/*/probe-*/metrics.jsonl; do
    [ -f "$f" ] && cp "$f" "$W/$(basename "$(dirname "$(dirname "$f")")")-$(basename "$(dirname "$f")").metrics.jsonl"
done
mkdir -p "$W/presets"
(cd "$W" && tar czf "$OUTD/frontier.tgz" code_version.json frontier.log presets $(ls speeds.jsonl *.metrics.jsonl 2>/dev/null))
cp "$LOG" "$OUTD/frontier.log"
exit "$rc"
