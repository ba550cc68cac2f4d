"""The DPO benchmark's data (benchmarks/dpo_gpu.sh): preference pairs as strings (prompt, chosen, rejected),
read as UTF-8 bytes by the catalog models (no tokenizer), each row about seq 1024 bytes; and the same
prompts with their chosen answers as prompt/completion records for the SFT run beside it, so both train on
rows of the same length.

    python3 benchmarks/sample_pairs.py [PAIRS] [SFT] [N]    # default /tmp/sc-dpo-pairs.jsonl /tmp/sc-dpo-sft.jsonl 240
"""

import json
import random
import sys

WORDS = ("shard gradient optimizer offload adapter rank checkpoint layer memory host device tensor step loss batch "
         "token window record sample parameter state").split()
KIND = ("clear", "careful", "correct", "helpful")
UNKIND = ("vague", "careless", "wrong", "rude")


def _text(rng: random.Random, n_bytes: int) -> str:
    out = []
    while sum(len(w) + 1 for w in out) < n_bytes:
        out.append(rng.choice(WORDS))
    return " ".join(out)


def write(pairs_path: str, sft_path: str, n: int) -> None:
    rng = random.Random(0)
    with open(pairs_path, "w") as pairs, open(sft_path, "w") as sft:
        for i in range(n):
            prompt = f"Question {i}: {_text(rng, 280)}?\nAnswer:"
            chosen = f" A {rng.choice(KIND)} answer: {_text(rng, 660)}."
            rejected = f" A {rng.choice(UNKIND)} answer: {_text(rng, 660)}."
            pairs.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
            sft.write(json.dumps({"prompt": prompt, "completion": chosen}) + "\n")


if __name__ == "__main__":
    a = sys.argv[1:]
    write(a[0] if a else "/tmp/sc-dpo-pairs.jsonl", a[1] if len(a) > 1 else "/tmp/sc-dpo-sft.jsonl",
          int(a[2]) if len(a) > 2 else 240)
