#!/usr/bin/env bash
# Issue 33: 7B full fine-tuning with offload (3090-7b-offload) beside LoRA (3090-7b-lora) and QLoRA
# (3090-7b-qlora), one H200 capped at 24 GiB by the presets: tokens/s, GPU (allocator and NVML) and host
# peaks, and the held-out loss after the same 12 steps of the same text from the same random base.
# About 6 minutes. Run from the repo root on the GPU machine after the wheelhouse line (PYTHONPATH set;
# the wheels must include peft and its needs, and bitsandbytes for the QLoRA run):
#     bash benchmarks/lora_7b_gpu.sh
# Writes $OUT/lora_7b.json (gpu_runs.py's rows, eval_loss included) and $OUT/lora_7b.log (its table).
set -u
OUTD=${OUT:-/tmp/lora_out}
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 SHARDCONSOLE_RUNS_ROOT=/tmp/sc-lora-runs SHARDCONSOLE_SPEEDS_FILE=/tmp/sc-lora-speeds.jsonl
python3 -c "import bitsandbytes, peft; print('bitsandbytes', bitsandbytes.__version__, 'peft', peft.__version__)" \
    || echo "bitsandbytes or peft missing: the QLoRA (or every adapter) run will be refused in one line"
# The text: 2 MB of numbered sentences, read as UTF-8 bytes by the catalog model (no tokenizer); 2% held out.
python3 - <<'PY'
import json, random
rng = random.Random(0)
words = ("shard gradient optimizer offload adapter rank checkpoint layer memory host device tensor "
         "step loss batch token window record sample parameter state").split()
with open("/tmp/sc-lora-text.jsonl", "w") as fh:
    for i in range(6000):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        s = " ".join(rng.choice(words) for _ in range(rng.randint(20, 40)))
        fh.write(json.dumps({"text": f"Record {i}: {a} plus {b} is {a + b}. {s.capitalize()}."}) + "\n")
PY
python3 benchmarks/gpu_runs.py --matrix issue33 --timeout 420 --out "$OUTD/lora_7b.json" 2>&1 | tee "$OUTD/lora_7b.log"
python3 - "$OUTD/lora_7b.json" <<'PY' | tee -a "$OUTD/lora_7b.log"
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
print("\n| run | tokens/s | GPU reserved peak GiB | NVML GiB | host GiB | held-out loss after 12 steps |")
print("|---|---|---|---|---|---|")
for r in rows:
    f = lambda v, spec: "-" if v is None else format(v, spec)
    print(f"| {r['name']} | {f(r['tokens_per_s'], ',.0f')} | {f(r['peak_reserved_gib'], '.1f')} | "
          f"{f(r['nvml_used_gib'], '.1f')} | {f(r['host_used_gib'], '.1f')} | {f(r['eval_loss'], '.4f')} |")
PY
