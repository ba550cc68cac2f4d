"""A seeded sample of training objectives x settings, each run for real (2 CPU ranks, the tiny model):
every point must run to the end or be refused before launch in one line; anything else is a crash.

    python3 scripts/objective_combos.py [--seed N] [--runs 24]

tests/test_combinations.py samples the settings for SFT; this draws train.objective too (sft, dpo, orpo,
simpo, kto, grpo, from the settings table's own choices), with the data each needs written here, and the
engine, method, offload, accumulation, micro-batch, checkpointing, activation offload, MLP tiles,
optimizer, master dtype, save and export around it. About 15 s a run on 2 cores. Exit 1 on a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardconsole.cli.settings import describe  # noqa: E402

DATA = {"sft": "text.jsonl", "dpo": "pairs.jsonl", "orpo": "pairs.jsonl", "simpo": "pairs.jsonl",
        "kto": "kto.jsonl", "grpo": "prompts.jsonl"}
REWARD = "def score(prompts, completions, answer, **kwargs):\n" \
         "    return [float(a in c) for c, a in zip(completions, answer)]\n"


def choices(key: str) -> list[Any]:
    return list(describe(*key.split("."))["allowed"])


def write_data(folder: Path) -> None:
    rows: dict[str, list[dict[str, Any]]] = {
        "text.jsonl": [{"text": f"line {i}: the quick brown fox jumps over the lazy dog"} for i in range(60)],
        "pairs.jsonl": [{"prompt": f"Q{i}: say yes", "chosen": " yes", "rejected": " no"} for i in range(40)],
        "kto.jsonl": [{"prompt": f"Q{i}: say yes", "completion": " yes" if i % 2 else " no", "label": bool(i % 2)}
                      for i in range(40)],
        "prompts.jsonl": [{"prompt": f"Q{i}: say yes", "answer": "yes"} for i in range(40)]}
    for name, records in rows.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "reward.py").write_text(REWARD)


def draw(rng: random.Random, folder: Path) -> dict[str, Any]:
    objective = rng.choice([o for o in choices("train.objective") if o in DATA])
    s: dict[str, Any] = {"train.objective": objective, "data.path": folder / DATA[objective],
                         "data.tokenizer": "bytes", "data.seq_len": 48, "train.steps": rng.choice([2, 3]),
                         "train.log_every": 1, "train.warmup_steps": 0}
    backend = s["parallel.backend"] = rng.choice(choices("parallel.backend"))
    if backend == "deepspeed":
        s["deepspeed.stage"] = rng.choice([0, 1, 2, 3])
        s["deepspeed.offload_optimizer"] = rng.choice(["none", "cpu"])
    else:
        s["fsdp.cpu_offload"] = rng.choice([False, True])
    s["train.method"] = rng.choice([m for m in choices("train.method") if m != "qlora"])    # qlora: CUDA only
    s["train.grad_accum"], s["train.micro_batch"] = rng.choice([1, 2]), rng.choice([1, 2])
    s["memory.activation_checkpointing"] = rng.choice([False, True])
    if s["memory.activation_checkpointing"] and rng.random() < 0.5:
        s["memory.activation_offload"] = True
    if backend == "fsdp" and rng.random() < 0.3:
        s["memory.mlp_tile_tokens"] = 16
    if backend == "fsdp" and rng.random() < 0.5:
        s["optim.name"] = rng.choice(choices("optim.name"))
    s["precision.master_dtype"] = rng.choice(choices("precision.master_dtype"))
    if s["precision.master_dtype"] == "bf16":
        s["precision.dtype"] = "bf16"
    if objective == "grpo":
        s.update({"grpo.reward": f"{folder / 'reward.py'}:score", "grpo.generations": 2, "grpo.max_new_tokens": 4,
                  "grpo.beta": rng.choice([0.0, 0.04]), "grpo.loss": rng.choice(choices("grpo.loss"))})
    s["train.save_final"] = rng.choice(choices("train.save_final"))
    if rng.random() < 0.5:
        s["train.export_dir"] = "EXPORT"
        if s["train.method"] == "lora":
            s["train.export_adapter"] = rng.choice([False, True])
        s["train.export_dtype"] = rng.choice(choices("train.export_dtype"))
    return s


def text(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=random.randrange(1_000_000))
    ap.add_argument("--runs", type=int, default=24)
    args = ap.parse_args()
    rng, crashes, counts = random.Random(args.seed), 0, {"ran": 0, "refused": 0}
    print(f"seed {args.seed}")
    with tempfile.TemporaryDirectory(prefix="objective-combos-") as tmp:
        folder = Path(tmp)
        write_data(folder)
        for i in range(args.runs):
            s, run = draw(rng, folder), folder / f"run{i}"
            argv = [sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless", "--run-dir", str(run)]
            for k, v in s.items():
                argv += ["--set", f"{k}={text(v).replace('EXPORT', str(run) + '-export')}"]
            res = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
            errors = [ln for ln in res.stderr.splitlines() if ln.startswith("shardconsole: error: ")]
            point = " ".join(f"{k}={text(v)}" for k, v in s.items() if not k.startswith("data."))
            if res.returncode == 0:
                counts["ran"] += 1
                print(f"[{i}] ran      {point}")
            elif res.returncode == 2 and len(errors) == 1 and not (run / "logs").exists():
                counts["refused"] += 1
                print(f"[{i}] refused  {point}\n      {errors[0]}")
            else:
                crashes += 1
                print(f"[{i}] CRASH exit {res.returncode}  {point}\n" + res.stderr[-3000:])
            shutil.rmtree(run, ignore_errors=True)
            shutil.rmtree(str(run) + "-export", ignore_errors=True)
    print(f"seed {args.seed}: {counts['ran']} ran to the end, {counts['refused']} refused in one line, {crashes} crashed")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
