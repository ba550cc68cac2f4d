#!/usr/bin/env bash
# Issue 48 on the GPU machine, one device call per part (each fits the 600 s a call may run). Run from the
# repo root after the wheelhouse line (../shared/gpu/wheelhouse.sh; PYTHONPATH set; .whl carried, with
# liger-kernel's wheel dropped in: `pip download --no-deps --only-binary=:all: liger-kernel==0.8.5 -d .whl`):
#     bash benchmarks/issue48_gpu.sh probe      # kernels alone: float8 layers, liger's norm/MLP/RoPE, the losses
#     bash benchmarks/issue48_gpu.sh numerics   # 1b 40 steps bf16 / tensorwise / rowwise: held-out loss; 7B fp8
#     bash benchmarks/issue48_gpu.sh ft-numerics  # 1b trained 200 steps, then fine-tuned 40 in bf16 / fp8, twice
#     bash benchmarks/issue48_gpu.sh new-transformers  # the 3b preset on transformers 5.25 + kernels (.whl/tf525:
#         pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
#         --platform any -d .whl/tf525 transformers==5.25.0 kernels==0.19.1 huggingface_hub==2.4.0
#         tokenizers==0.23.3 hf-xet==1.8.0 typer==0.29.2): its compile line must say no graph break
#     bash benchmarks/issue48_gpu.sh 7b         # 7B fp32 masters under 24 GiB: preset, + fp8, bare peer
#     bash benchmarks/issue48_gpu.sh 7b-mb14|7b-mb16  # the same over 10 steps, fp8 at micro-batch 14 or 16
#     bash benchmarks/issue48_gpu.sh 13b|3b|1b|zero3   # the other targets, the same way
#     bash benchmarks/issue48_gpu.sh rows NAME...  # any rows of the issue48-targets matrix, into issue48_rows.json
#     bash benchmarks/issue48_gpu.sh profile PRESET [--set K=V ...]  # SHARDCONSOLE_PROFILE over steps 8-10
# Writes $OUT/issue48_<part>.json (gpu_runs.py's rows, or the probes') and .log; README's 24 GB table and
# docs/MEASURED.md's "FP8 linears and the fused loss" take their figures from these files.
set -u
part=${1:?probe, numerics, 7b, 13b, 3b, 1b or zero3}
OUTD=${OUT:-/tmp/issue48_out}
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_RUNS_ROOT=/tmp/sc-48-runs SHARDCONSOLE_SPEEDS_FILE=/tmp/sc-48-speeds.jsonl
python3 benchmarks/sample_text.py /tmp/sc-lora-text.jsonl
case "$part" in
  probe)
    python3 benchmarks/fp8_probe.py --layers 4 --mb 6 --seq 2048 --out "$OUTD/issue48_probe.json" 2>&1 | tail -60
    [ -f benchmarks/fused_loss_gpu.py ] && python3 benchmarks/fused_loss_gpu.py --out "$OUTD/issue48_fused_loss.json" 2>&1 | tail -40
    ;;
  numerics)
    python3 benchmarks/gpu_runs.py --matrix issue48-fp8 --timeout 240 --out "$OUTD/issue48_numerics.json" 2>&1 \
      | grep -v '^{' | tee "$OUTD/issue48_numerics.log"
    ;;
  ft-numerics)
    # the base: 200 bf16 steps of the sample text, the same 2% held out (same seed), exported as a HF folder
    python3 -m shardconsole --preset h200-fsdp --headless --run-dir /tmp/sc-48-runs/base \
      --set data.path=/tmp/sc-lora-text.jsonl --set data.eval_fraction=0.02 --set train.steps=200 \
      --set train.log_every=50 --set train.save_final=false --set train.export_dir=/tmp/sc-48-base 2>&1 | tail -2
    python3 benchmarks/gpu_runs.py --matrix issue48-ft --timeout 150 --out "$OUTD/issue48_ft.json" 2>&1 \
      | grep -v '^{' | tee "$OUTD/issue48_ft.log"
    rm -rf /tmp/sc-48-base
    ;;
  new-transformers)
    # what a fresh install gets (the GPU image has transformers 5.17 without `kernels`): compiled checkpointed
    # layers must compile whole (modeling.apply_checkpointing), beside the image's transformers in one call
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-tf .whl/tf525/*.whl || exit
    for tf in image new; do
      pp=$PYTHONPATH; [ "$tf" = new ] && pp=/tmp/site-tf:$PYTHONPATH
      PYTHONPATH=$pp python3 -c "import transformers; print('transformers', transformers.__version__)"
      PYTHONPATH=$pp python3 benchmarks/gpu_runs.py --matrix issue48-targets --only 3b-adamw8bit-preset \
        --timeout 200 --plan --out "$OUTD/issue48_tf_$tf.json" 2>&1 | grep -v '^{' | tee -a "$OUTD/issue48_tf.log"
      grep -o '"[^"]*compile[^"]*"' "$OUTD/issue48_tf_$tf.json" | tee -a "$OUTD/issue48_tf.log"
    done
    ;;
  7b-mb14|7b-mb16)
    # the 7B target's row as it would ship: fp8 at mb 14 or 16 (what its smaller activations let fit) beside the
    # unchanged preset, 10 steps each, and the bare peer: about 7 min
    python3 benchmarks/gpu_runs.py --matrix issue48-check --only 7b-fp32-none-10 "7b-fp32-tensorwise-${part#7b-}-10" \
      --timeout 200 --plan --out "$OUTD/issue48_$part.json" 2>&1 | grep -v '^{' | tee "$OUTD/issue48_$part.log"
    python3 benchmarks/gpu_runs.py --matrix issue48-targets --only bare-7b-fsdp2-offload-mb12 \
      --timeout 170 --out "$OUTD/issue48_7b_bare.json" 2>&1 | grep -v '^{' | tee -a "$OUTD/issue48_$part.log"
    ;;
  7b|13b|3b|1b|zero3)
    case "$part" in
      7b) only="7b-fp32-preset 7b-fp32-fp8 bare-7b-fsdp2-offload-mb12" ;;
      13b) only="13b-stoch-preset 13b-stoch-fp8 bare-13b-fsdp2-offload-mb9" ;;
      3b) only="3b-adamw8bit-preset 3b-fp8-preset-bf16 3b-fp8-preset bare-3b-torchtune-adamw8bit-bwd-mb4" ;;
      1b) only="1b-fsdp-preset 1b-fsdp-fp8 bare-1b-fsdp2-mb8" ;;
      zero3) only="1b-zero3-preset 1b-zero3-fp8 bare-1b-zero3-mb8" ;;
    esac
    # shellcheck disable=SC2086
    python3 benchmarks/gpu_runs.py --matrix issue48-targets --only $only --timeout 280 --plan \
      --out "$OUTD/issue48_$part.json" 2>&1 | grep -v '^{' | tee "$OUTD/issue48_$part.log"
    ;;
  rows)
    shift
    python3 benchmarks/gpu_runs.py --matrix issue48-targets --only "$@" --timeout 200 --plan \
      --out "$OUTD/issue48_rows_$1.json" 2>&1 | grep -v '^{' | tee -a "$OUTD/issue48_rows.log"
    ;;
  profile)
    preset=$2; shift 2
    tag=$preset$(printf '%s' "$*" | tr -c 'A-Za-z0-9._-' '_')
    SHARDCONSOLE_PROFILE=8-10 python3 -m shardconsole --preset "$preset" --headless --run-dir "/tmp/sc-48-runs/prof" \
      --set train.steps=10 --set train.save_final=false --set train.log_every=1 "$@" 2>&1 | tail -3
    grep -h "profile steps" /tmp/sc-48-runs/prof/logs/rank0.log | tee -a "$OUTD/issue48_profile.log"
    head -45 /tmp/sc-48-runs/prof/profile/rank0.txt > "$OUTD/profile_${tag:0:60}.txt"
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
rm -rf /tmp/sc-48-runs
