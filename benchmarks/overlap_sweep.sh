#!/usr/bin/env bash
# Issue 35 item 1: the offload overlap's contention with the thread that launches the backward. One run a
# row, its host step's OpenMP threads swept one count a step (SHARDCONSOLE_OVERLAP_THREADS=15,10,...: the
# rank log says which step had which), so one build and pinning serve every count. Rows: 3b (blocking
# events, then pinned to all cores but one, then the old spinning events at 15 threads, then no overlap), 7B fp32
# masters, 13B stochastic. Run from the repo root on the GPU machine:
#     bash benchmarks/overlap_sweep.sh 3b 7b        (about 6 minutes)
#     bash benchmarks/overlap_sweep.sh 13b          (about 4)
#     bash benchmarks/overlap_sweep.sh 7b-fp32 13b-stoch 3b-blocking   (single rows by name)
# Writes $OUT/sweep/NAME/{metrics.jsonl,rank0.log}; `python3 benchmarks/overlap_sweep.py $OUT/sweep`
# prints each thread count's median step beside the offload view's parts.
set -u
OUTD=${OUT:-/tmp/overlap_sweep_out}/sweep
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_SPEEDS_FILE=/tmp/sc-sweep-speeds.jsonl
COMMON=(--headless --set train.clip_grad_norm=0 --set train.log_every=1 --set train.warmup_steps=1
        --set train.save_final=false --set fsdp.offload_overlap=true)
row() {   # NAME PRESET STEPS THREADS [ENV=V ...] -- [--set ...]
    local name=$1 preset=$2 steps=$3 threads=$4; shift 4
    local envs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    local dir=/tmp/sc-sweep/$name
    rm -rf "$dir"; mkdir -p "$OUTD/$name"
    echo "== $name: $preset threads $threads ${envs[*]} $*"
    env SHARDCONSOLE_OVERLAP_THREADS="$threads" "${envs[@]}" timeout 300 python3 -m shardconsole --preset "$preset" \
        "${COMMON[@]}" --set "train.steps=$steps" --run-dir "$dir" "$@" 2>&1 | tail -3
    cp "$dir/metrics.jsonl" "$OUTD/$name/" 2>/dev/null; cp "$dir/logs/rank0.log" "$OUTD/$name/" 2>/dev/null
    rm -rf "$dir"
}
for what in "$@"; do
    case $what in
    3b) set -- 3b-blocking 3b-pinned 3b-spin 3b-off ;;
    7b) set -- 7b-fp32 ;;
    13b) set -- 13b-stoch ;;
    *) set -- "$what" ;;
    esac
    for one in "$@"; do
        case $one in
        3b-blocking) row 3b-blocking 3090-offload 11 15,12,8,6,4 -- --set model.name=3b ;;
        3b-pinned) row 3b-pinned 3090-offload 11 15,12,8,6,4 SHARDCONSOLE_OVERLAP_PIN=1 -- --set model.name=3b ;;
        3b-base) row 3b-base 3090-offload 9 15 -- --set model.name=3b ;;
        3b-nice) row 3b-nice 3090-offload 9 16,15 SHARDCONSOLE_OVERLAP_NICE=10 -- --set model.name=3b ;;
        3b-spin) row 3b-spin 3090-offload 6 15 SHARDCONSOLE_OVERLAP_SPIN=1 -- --set model.name=3b ;;
        3b-off) row 3b-off 3090-offload 6 15 -- --set model.name=3b --set fsdp.offload_overlap=false ;;
        7b-fp32) row 7b-fp32 3090-7b-offload 8 15,10,6 -- --set precision.master_dtype=fp32 --set train.micro_batch=8 ;;
        7b-pinned) row 7b-pinned 3090-7b-offload 8 15,10,6 SHARDCONSOLE_OVERLAP_PIN=1 -- --set precision.master_dtype=fp32 --set train.micro_batch=8 ;;
        13b-stoch) row 13b-stoch 3090-7b-offload 6 15,8 -- --set model.name=13b --set precision.master_rounding=stochastic --set train.micro_batch=8 ;;
        *) echo "unknown row $one (3b 7b 13b, or one of 3b-blocking 3b-pinned 3b-base 3b-nice 3b-spin 3b-off 7b-fp32 7b-pinned 13b-stoch)" ;;
        esac
    done
done
