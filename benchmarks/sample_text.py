"""The GPU benchmarks' text: 6,000 numbered records (~2 MB) of arithmetic and field words, read as UTF-8
bytes by the catalog models (no tokenizer), the same file for every script that compares held-out
losses (lora_7b_gpu.sh, issue35_gpu.sh, gpu_runs.py's matrices that name /tmp/sc-lora-text.jsonl).

    python3 benchmarks/sample_text.py [PATH]      # default /tmp/sc-lora-text.jsonl
"""

import json
import random
import sys


def write(path: str) -> None:
    rng = random.Random(0)
    words = ("shard gradient optimizer offload adapter rank checkpoint layer memory host device tensor "
             "step loss batch token window record sample parameter state").split()
    with open(path, "w") as fh:
        for i in range(6000):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            s = " ".join(rng.choice(words) for _ in range(rng.randint(20, 40)))
            fh.write(json.dumps({"text": f"Record {i}: {a} plus {b} is {a + b}. {s.capitalize()}."}) + "\n")


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else "/tmp/sc-lora-text.jsonl")
