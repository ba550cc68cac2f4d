"""A Hugging Face model folder of a catalog shape with random weights, drawn on the GPU (no network on the GPU
machine: nothing to download). Drawn on a CPU, an 8B model took 248 s of a 600 s device call; on a GPU
it is seconds, and the folder is what a user's download looks like to the ranks (config.json,
generation_config.json, sharded model.safetensors with its index).

    python3 benchmarks/model_folder.py llama3-8b /tmp/sc-llama3-8b [--dtype bf16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardconsole.settings import models  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name", choices=sorted(models.CATALOG))
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM
    t0 = time.time()
    from shardconsole.backends.model.modeling import transformers_config
    config = transformers_config(models.resolve(args.name))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    drawn = time.time() - t0
    lm.save_pretrained(args.out, max_shard_size="5GB")
    n = sum(p.numel() for p in lm.parameters())
    print(f"{args.out}: {args.name}, {n:,} parameters in {args.dtype}, drawn on {device} in {drawn:.0f} s, "
          f"written in {time.time() - t0 - drawn:.0f} s")


if __name__ == "__main__":
    main()
