"""Run presets for real through the product's headless path and report tokens/s, MFU and memory.

Each entry of the matrix is `NAME PRESET [--set k=v ...]`; every run goes through
`python -m shardconsole --preset ... --headless` exactly as a user would start it, and the figures
come from the run's own metrics.jsonl (median of the step lines after warm-up).

    python3 benchmarks/gpu_runs.py --out $OUT/runs.json --matrix issue2
    python3 benchmarks/gpu_runs.py --list
    python3 benchmarks/gpu_runs.py --markdown $OUT/runs.json      # a results file as a markdown table

`--overhead` also runs the same worker under bare torchrun with the stream off
(SHARDCONSOLE_STREAM=off, no front end) to measure what the console's machinery costs.

An entry whose preset is `bare:fsdp2` or `bare:deepspeed` is a bare peer: benchmarks/bare_loops.py
(the plain library loop, no shardconsole) under torchrun, its list the loop's arguments. Put a peer in
the same matrix as the run it is read against: figures move up to 30% between calls on a shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from shardconsole.settings import config as C  # noqa: E402
from shardconsole.launch.job import build_argv  # noqa: E402
from shardconsole.runlog.protocol import decode  # noqa: E402

Z3 = ["parallel.backend=deepspeed", "deepspeed.stage=3", "train.compile=false", "train.steps=15", "train.log_every=5"]
OFF = ["train.steps=8", "train.log_every=2"]
# The bare peers' shape of 3090-offload at 3.1B: full offload, checkpointing, 24 GiB cap, seq 2048.
BARE_3B = ["--model", "3b", "--offload", "all", "--checkpointing", "--gpu-memory-limit", "24", "--steps", "8",
           "--warmup", "3"]
CURVE = ["model.name=125m", "train.compile=false", "train.steps=500", "train.log_every=10", "data.seq_len=1024"]

L3_8B = "/tmp/sc-llama3-8b"     # benchmarks/model_folder.py writes it on the GPU machine
# NAME, PRESET, --set values
MATRICES: dict[str, list[tuple[str, str, list[str]]]] = {
    "issue2": [
        ("h200-fsdp", "h200-fsdp", ["train.steps=30"]),
        ("h200-fsdp-nocompile", "h200-fsdp", ["train.steps=30", "train.compile=false"]),
        ("3090-offload", "3090-offload", ["train.steps=12", "train.log_every=2"]),
        ("3090-fsdp", "3090-fsdp", ["train.steps=20"]),
    ],
    "perf": [
        ("h200-fsdp", "h200-fsdp", ["train.steps=40"]),
        ("h200-fsdp+ac", "h200-fsdp", ["train.steps=40", "memory.activation_checkpointing=true"]),
        ("3b-fsdp-mb4", "h200-fsdp", ["train.steps=30", "model.name=3b", "train.micro_batch=4"]),
    ],
    "issue3": [
        ("zero3-1b", "h200-fsdp", ["parallel.backend=deepspeed", "deepspeed.stage=3", "train.compile=false",
                                   "train.steps=25", "train.log_every=5"]),
        ("4090x2-zero3-on-1gpu", "4090x2-zero3", ["parallel.nproc_per_node=1", "train.steps=12",
                                                  "train.log_every=2"]),
        ("h200-fsdp", "h200-fsdp", ["train.steps=30"]),
    ],
    # Issue 7, speed: checkpointing with compiled layers (full: the checkpoint inside the compiled
    # layer; selective: matmul/attention outputs kept) and ZeRO-3 levers on one GPU.
    "issue7-perf": [
        ("fsdp-1b-compile+ac", "h200-fsdp", ["train.steps=30", "train.log_every=5",
                                             "memory.activation_checkpointing=true"]),
        ("fsdp-1b-compile+ac-selective", "h200-fsdp", ["train.steps=30", "train.log_every=5",
                                                       "memory.activation_checkpointing=true",
                                                       "memory.checkpoint_policy=selective"]),
        ("z3-1b", "h200-fsdp", Z3),
        ("z3-1b-persist", "h200-fsdp", Z3 + ["deepspeed.stage3_param_persistence_threshold=10000000000"]),
        ("z3-1b-nooverlap", "h200-fsdp", Z3 + ["deepspeed.overlap_comm=false"]),
        ("z3-1b-persist-nocontig", "h200-fsdp", Z3 + ["deepspeed.stage3_param_persistence_threshold=10000000000",
                                                      "deepspeed.contiguous_gradients=false"]),
    ],
    # FSDP2 offload against DeepSpeed's on the 3.1B / 24 GiB case (3090-offload: full shard + offload +
    # checkpointing, mb 4, seq 2048; as DeepSpeed: ZeRO-3 with params and optimizer on the CPU).
    "issue7-offload": [
        ("off-3b-fsdp", "3090-offload", OFF + ["model.name=3b"]),
        ("off-3b-ds", "3090-offload", OFF + ["model.name=3b", "parallel.backend=deepspeed"]),
    ],
    # The 24 GiB table's offload rows and the bf16-master trade-off (issue 7): under the 3090-offload
    # preset's 24 GiB cap, full offload + checkpointing, on the 125 GiB host of the H200 machine.
    "issue7": [
        ("off-7b-fsdp-mb8-unpinned", "3090-offload", ["model.name=7b", "train.micro_batch=8", "fsdp.pin_memory=false",
                                                      "train.steps=4", "train.log_every=1", "train.warmup_steps=1"]),
        ("off-13b-fsdp-bf16master-mb4-unpinned", "3090-offload",
         ["model.name=13b", "train.micro_batch=4", "precision.master_dtype=bf16", "fsdp.pin_memory=false",
          "train.steps=3", "train.log_every=1", "train.warmup_steps=1"]),
        ("off-7b-fsdp-bf16master-mb8", "3090-offload", ["model.name=7b", "train.micro_batch=8",
                                                        "precision.master_dtype=bf16", "train.steps=4",
                                                        "train.log_every=1", "train.warmup_steps=1"]),
        ("curve-125m-fp32master", "h200-fsdp", CURVE),
        ("curve-125m-bf16master", "h200-fsdp", CURVE + ["precision.master_dtype=bf16"]),
    ],
    # Issue 7, second pass. ZeRO-3 1b: each decoder layer gathered whole (deepspeed.stage3_layer_gather,
    # now the default) eager and with the layer bodies compiled (the preset's train.compile), against
    # the per-Linear hooks of before. Offload 3.1B: FSDP2 (the clip folded into the fused step, the norm
    # on every host core) with and without the bf16 host copy as all-gather input, and DeepSpeed.
    "issue7-z3": [
        ("z3-1b-layer", "h200-fsdp", Z3 + ["train.steps=30"]),
        ("z3-1b-layer-compile", "h200-fsdp", [s for s in Z3 if s != "train.compile=false"] + ["train.steps=30"]),
        ("z3-1b-modules", "h200-fsdp", Z3 + ["train.steps=30", "deepspeed.stage3_layer_gather=false"]),
        ("z3-1b-layer-compile-2", "h200-fsdp", [s for s in Z3 if s != "train.compile=false"] + ["train.steps=30"]),
    ],
    "issue7-offload2": [
        ("off-3b-fsdp-copy", "3090-offload", OFF + ["model.name=3b", "fsdp.offload_compute_copy=true"]),
        ("off-3b-fsdp-nocopy", "3090-offload", OFF + ["model.name=3b", "fsdp.offload_compute_copy=false"]),
        ("off-3b-ds", "3090-offload", OFF + ["model.name=3b", "parallel.backend=deepspeed"]),
    ],
    # Issue 7, third pass (2026-11-30): the norm summed on the GPU at each reduce-scatter
    # (offload.DeviceGradNorm, on for every offloaded FSDP2 run) against DeepSpeed, interleaved and
    # repeated: runs of one setting on this shared host spread by up to 20% between calls.
    "issue7-offload3": [
        (f"off-3b-{name}-{k}", "3090-offload", OFF + ["model.name=3b"] + sets)
        for k in (1, 2)
        for name, sets in (("fsdp", []), ("ds", ["parallel.backend=deepspeed"]))
    ],
    # The presets the tables above left out (tiny-cpu runs on CPU ranks by design).
    "presets-rest": [
        ("ddp-baseline", "ddp-baseline", []),
    ],
    # Issue 8 (several GPUs), on nvidia-h200-x2: the one-GPU h200-fsdp preset on both GPUs.
    "issue8-x2": [
        ("h200-fsdp-2gpu", "h200-fsdp", ["parallel.nproc_per_node=2", "train.steps=20", "train.log_every=5"]),
    ],
    # Issue 17. The README's 125m 500-step curve under each way of keeping the masters (run together on
    # one GPU with --parallel: each is small), then the 24 GiB targets with fp32-quality updates on the
    # host arena: 7B fp32 masters pinned, 13B bf16 masters with stochastic rounding, 3.1B FSDP2 offload.
    "issue17-curves": [
        ("curve-125m-fp32master", "h200-fsdp", CURVE),
        ("curve-125m-bf16-nearest", "h200-fsdp", CURVE + ["precision.master_dtype=bf16",
                                                          "precision.master_rounding=nearest"]),
        ("curve-125m-bf16-stochastic", "h200-fsdp", CURVE + ["precision.master_dtype=bf16",
                                                             "precision.master_rounding=stochastic"]),
        ("curve-125m-bf16-kahan", "h200-fsdp", CURVE + ["precision.master_dtype=bf16",
                                                        "precision.master_rounding=kahan"]),
    ],
    "issue17-big": [
        # No final save: 7B's is 81 GB (fp32 weights and moments), more than the machine's disk.
        ("off-7b-fp32master-arena-mb8", "3090-7b-offload", ["precision.master_dtype=fp32", "train.steps=5",
                                                            "train.log_every=1", "train.warmup_steps=1",
                                                            "train.save_final=false"]),
        # --force: written when the planner did not count the arena (it refused this at 133 GiB of host);
        # it plans 116.2 GiB now (issue17-13b runs it without).
        ("off-13b-bf16-stochastic-mb8", "3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic",
                                                            "train.steps=4", "train.log_every=1",
                                                            "train.warmup_steps=1", "train.save_final=false",
                                                            "--force"]),
        ("off-3b-fsdp-arena", "3090-offload", OFF + ["model.name=3b", "train.save_final=false"]),
    ],
    # Issue 17's targets against the bare peers, one H200 capped at 24 GiB, seq 2048, fp32-quality updates.
    # Each group is one device call (a call has 10 minutes): the 3.1B FSDP2 offload pair, the 13B/7B
    # arena runs, then DeepSpeed's offload against its bare loop.
    "issue17-3b": [
        ("off-3b-fsdp-arena-mb4", "3090-offload", OFF + ["model.name=3b", "train.save_final=false"]),
        ("bare-3b-fsdp2-offload-mb4", "bare:fsdp2", BARE_3B + ["--micro-batch", "4"]),
        ("off-3b-fsdp-arena-mb8", "3090-offload", OFF + ["model.name=3b", "train.micro_batch=8",
                                                         "train.save_final=false"]),
    ],
    "issue17-13b": [
        ("off-13b-bf16-stochastic-mb8", "3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic",
                                                            "train.steps=4", "train.log_every=1",
                                                            "train.warmup_steps=1", "train.save_final=false"]),
        ("off-7b-fp32master-arena-mb8", "3090-7b-offload", ["precision.master_dtype=fp32", "train.steps=5",
                                                            "train.log_every=1", "train.warmup_steps=1",
                                                            "train.save_final=false"]),
    ],
    "issue17-ds": [
        ("off-3b-ds", "3090-offload", OFF + ["model.name=3b", "parallel.backend=deepspeed",
                                            "train.save_final=false"]),
        ("bare-3b-ds-offload-mb4", "bare:deepspeed", BARE_3B + ["--micro-batch", "4"]),
        ("4090x2-zero3-1gpu-bf16", "4090x2-zero3", ["parallel.nproc_per_node=1", "precision.dtype=bf16",
                                                    "train.steps=12", "train.log_every=2", "train.save_final=false"]),
        ("bare-1b-ds-optoff-mb8-seq512", "bare:deepspeed", ["--model", "1b", "--seq-len", "512", "--micro-batch", "8",
                                                            "--offload", "optimizer", "--checkpointing",
                                                            "--gpu-memory-limit", "24", "--steps", "12",
                                                            "--warmup", "4"]),
    ],
    # NVMe offload (DeepSpeed's async I/O; benchmarks/nvme_3b_gpu.sh brings libaio) against CPU offload.
    "issue17-nvme": [
        ("off-3b-ds-cpu", "3090-offload", OFF + ["model.name=3b", "parallel.backend=deepspeed",
                                                "train.save_final=false"]),
        ("off-3b-ds-nvme-optimizer", "3090-offload", OFF + ["model.name=3b", "parallel.backend=deepspeed",
                                                           "deepspeed.offload_optimizer=nvme",
                                                           "deepspeed.nvme_path=/tmp/sc-nvme",
                                                           "train.save_final=false"]),
    ],
    # Issue 33: 7B full fine-tuning (offload) beside LoRA and QLoRA, one H200 capped at 24 GiB, the same
    # random base (one seed), the same text (benchmarks/lora_7b_gpu.sh writes it), the same tokens a step
    # (8 x 2048) and steps, each preset's own learning rate; the held-out loss after the last step.
    "issue33": [
        (name, preset, ["data.path=/tmp/sc-lora-text.jsonl", "data.eval_fraction=0.02", "train.steps=12",
                        "train.log_every=1", "train.warmup_steps=2", "train.save_final=false"])
        for name, preset in (("7b-full-offload-bf16m", "3090-7b-offload"), ("7b-lora-r16", "3090-7b-lora"),
                             ("7b-qlora-r16", "3090-7b-qlora"))
    ],
    # Issue 33, the LoRA planner's calibration: 7B LoRA and QLoRA (and QLoRA with the adapters' dropout,
    # and 13B QLoRA) on one H200 capped at 24 GiB by their presets, measured peaks beside `plan --json`'s
    # (run with --plan). The QLoRA rows' rank0.log line "qlora: build peak ..." is the build's own peak:
    # the memory lines' peaks are training's (backends/model/qlora.py resets them after the build).
    "issue33cal": [
        (name, preset, ["data.path=/tmp/sc-lora-text.jsonl", "data.eval_fraction=0.02", "train.steps=8",
                        "train.log_every=1", "train.warmup_steps=2", "train.save_final=false", *extra])
        for name, preset, extra in (("7b-lora-r16", "3090-7b-lora", []), ("7b-qlora-r16", "3090-7b-qlora", []),
                                    ("7b-qlora-r16-dropout", "3090-7b-qlora", ["lora.dropout=0.05"]),
                                    ("13b-qlora-r16", "3090-13b-qlora", []))
    ],
    # Issue 35: 3b without offload on torchao's 8-bit AdamW (bf16 masters: 5.9 GiB of weights, 5.9 of 8-bit
    # states) beside the offload recipe at 3b, same micro-batch, text and steps: tokens/s and held-out loss.
    # optim.step_in_backward beside the ordinary step, the torchtune-style bare peer (benchmarks/
    # bare_loops.py: same model, text, held-out records, micro-batch, steps, constant lr 3e-4, betas) and
    # the offload recipe. 7B stays out: the planner puts 7B at 24-27 GiB even on 4-bit states with mb 1.
    "issue35": [
        (name, preset, ["model.name=3b", "train.micro_batch=2", "data.path=/tmp/sc-lora-text.jsonl",
                        "data.eval_fraction=0.02", "train.steps=16", "train.log_every=1", "train.warmup_steps=0",
                        "train.schedule=constant", "train.save_final=false", *extra])
        for name, preset, extra in (
            ("3b-adamw8bit-bf16m-step-in-bwd", "3090-fsdp", ["optim.name=adamw8bit", "precision.master_dtype=bf16",
                                                             "optim.step_in_backward=true", "train.clip_grad_norm=0"]),)
    ] + [
        ("bare-3b-torchtune-adamw8bit-bwd", "bare:fsdp2",
         ["--model", "3b", "--micro-batch", "2", "--steps", "16", "--warmup", "5", "--master-dtype", "bf16",
          "--optim", "adamw8bit", "--step-in-backward", "--reduce-dtype", "bf16", "--checkpointing",
          "--gpu-memory-limit", "24", "--data", "/tmp/sc-lora-text.jsonl", "--eval-fraction", "0.02",
          "--seed", "1234"]),
    ] + [
        (name, preset, ["model.name=3b", "train.micro_batch=2", "data.path=/tmp/sc-lora-text.jsonl",
                        "data.eval_fraction=0.02", "train.steps=16", "train.log_every=1", "train.warmup_steps=0",
                        "train.schedule=constant", "train.save_final=false", *extra])
        for name, preset, extra in (
            ("3b-adamw-offload", "3090-offload", []),
            ("3b-adamw8bit-bf16m-no-offload", "3090-fsdp", ["optim.name=adamw8bit", "precision.master_dtype=bf16"]))
    ],
    # Issue 35 item 1, fsdp.offload_overlap on and off, under the presets' 24 GiB cap, no clip (a clip needs
    # the global norm before any update: with one the step runs after the backward, as with the overlap off).
    # Targets: step <= 1.15 x max(GPU, host step, H2D + D2H); 7B fp32 masters >= 5,500 tokens/s, 13B
    # stochastic >= 3,000. `--overlap-table` prints those figures. Walls of earlier H200 calls (most of it
    # the build and pinning): 3b ~60 s, 7B fp32 ~100 s, 13B ~190 s a run, so the first five rows are ~8.5
    # minutes and the 13B off row is a call of its own (--only 13b-stoch-overlap-off).
    "issue35-overlap": [
        (f"{name}-overlap-{on}", preset, [*sets, f"fsdp.offload_overlap={'true' if on == 'on' else 'false'}",
                                          "train.clip_grad_norm=0", "train.log_every=1", "train.warmup_steps=1",
                                          "train.save_final=false", f"train.steps={steps}"])
        for name, preset, sets, steps, ons in (
            ("3b", "3090-offload", ["model.name=3b"], 5, ("on", "off")),
            ("7b-fp32", "3090-7b-offload", ["precision.master_dtype=fp32", "train.micro_batch=8"], 4, ("on", "off")),
            ("13b-stoch", "3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic",
                                              "train.micro_batch=8"], 3, ("on",)),
            ("13b-stoch", "3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic",
                                              "train.micro_batch=8"], 3, ("off",)))
        for on in ons
    ] + [
        # The bare FSDP2 offload loops beside them: the same shapes (full offload, checkpointing, the cap).
        ("bare-3b-fsdp2-offload-mb4", "bare:fsdp2", BARE_3B + ["--micro-batch", "4"]),
        ("bare-7b-fsdp2-offload-mb8", "bare:fsdp2", ["--model", "7b", "--offload", "all", "--checkpointing",
                                                     "--gpu-memory-limit", "24", "--steps", "4", "--warmup", "2",
                                                     "--micro-batch", "8"]),
    ],
    # Issue 35's last call pair. A: the 7B recipe as the preset now runs it (no clip: the host step
    # under the backward) with fp32 masters at mb 8 and 12, its bare FSDP2 peer, 13B stochastic.
    # B: 3b without offload (3090-3b-adamw8bit) at mb 2/4/6 beside the torchtune-style bare loop at the
    # same shapes, and 3b with offload (3090-offload at 3b: the article's clip 1.0, then no clip) beside
    # the bare FSDP2 offload loop.
    "issue35-final": [
        (f"7b-fp32-mb{mb}", "3090-7b-offload", ["precision.master_dtype=fp32", f"train.micro_batch={mb}",
                                                "train.log_every=1", "train.warmup_steps=1",
                                                "train.save_final=false", "train.steps=4"])
        for mb in (8, 12)
    ] + [
        ("bare-7b-fsdp2-offload-mb8", "bare:fsdp2", ["--model", "7b", "--offload", "all", "--checkpointing",
                                                     "--gpu-memory-limit", "24", "--steps", "4", "--warmup", "2",
                                                     "--micro-batch", "8"]),
        ("bare-7b-fsdp2-offload-mb12", "bare:fsdp2", ["--model", "7b", "--offload", "all", "--checkpointing",
                                                      "--gpu-memory-limit", "24", "--steps", "4", "--warmup", "2",
                                                      "--micro-batch", "12"]),
        ("7b-preset", "3090-7b-offload", ["train.log_every=1", "train.warmup_steps=1", "train.save_final=false",
                                          "train.steps=4"]),
        ("3b-adamw8bit-preset", "3090-3b-adamw8bit", ["train.steps=10", "train.warmup_steps=1",
                                                      "train.save_final=false"]),
        ("13b-stoch", "3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic",
                                          "train.micro_batch=8", "train.log_every=1", "train.warmup_steps=1", "train.save_final=false",
                                          "train.steps=3"]),
    ] + [
        (f"3b-adamw8bit-mb{mb}", "3090-3b-adamw8bit", [f"train.micro_batch={mb}", "train.steps=10",
                                                       "train.warmup_steps=1", "train.save_final=false"])
        for mb in (2, 4, 6)
    ] + [
        (f"bare-3b-torchtune-adamw8bit-bwd-mb{mb}", "bare:fsdp2",
         ["--model", "3b", "--micro-batch", str(mb), "--steps", "10", "--warmup", "4", "--master-dtype", "bf16",
          "--optim", "adamw8bit", "--step-in-backward", "--reduce-dtype", "bf16", "--checkpointing",
          "--gpu-memory-limit", "24"])
        for mb in (2, 4, 6)
    ] + [
        (f"3b-offload-mb4-{name}", "3090-offload", ["model.name=3b", "train.log_every=1", "train.warmup_steps=1",
                                                    "train.save_final=false", "train.steps=5", *sets])
        for name, sets in (("clip1", []), ("noclip", ["train.clip_grad_norm=0"]))
    ] + [
        ("bare-3b-fsdp2-offload-mb4", "bare:fsdp2", BARE_3B + ["--micro-batch", "4"]),
    ],
    # Issue 35's confirming call: the presets as shipped, each beside its bare peer, and 13b on the 7B
    # preset with no micro-batch named (the launch fits the preset's 12 down and says so).
    "issue35-confirm": [
        ("13b-stoch-fitted", "3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic",
                                                 "train.log_every=1", "train.warmup_steps=1",
                                                 "train.save_final=false", "train.steps=3"]),
        ("7b-fp32-preset", "3090-7b-offload", ["precision.master_dtype=fp32", "train.log_every=1",
                                               "train.warmup_steps=1", "train.save_final=false", "train.steps=4"]),
        ("bare-7b-fsdp2-offload-mb12", "bare:fsdp2", ["--model", "7b", "--offload", "all", "--checkpointing",
                                                      "--gpu-memory-limit", "24", "--steps", "4", "--warmup", "2",
                                                      "--micro-batch", "12"]),
        ("3b-adamw8bit-preset", "3090-3b-adamw8bit", ["train.steps=10", "train.warmup_steps=1",
                                                      "train.save_final=false"]),
        ("bare-3b-torchtune-adamw8bit-bwd-mb4", "bare:fsdp2",
         ["--model", "3b", "--micro-batch", "4", "--steps", "10", "--warmup", "4", "--master-dtype", "bf16",
          "--optim", "adamw8bit", "--step-in-backward", "--reduce-dtype", "bf16", "--checkpointing",
          "--gpu-memory-limit", "24"]),
        ("3b-offload-mb4", "3090-offload", ["model.name=3b", "train.log_every=1", "train.warmup_steps=1",
                                            "train.save_final=false", "train.steps=5"]),
        ("bare-3b-fsdp2-offload-mb4", "bare:fsdp2", BARE_3B + ["--micro-batch", "4"]),
    ] + [
        # 3b without offload with its layers compiled (train.compile), at the preset's mb 4 and at 6
        (f"3b-adamw8bit-compiled-mb{mb}", "3090-3b-adamw8bit", ["train.compile=true", f"train.micro_batch={mb}",
                                                               "train.steps=14", "train.warmup_steps=1",
                                                               "train.save_final=false"])
        for mb in (4, 6)
    ] + [
        # the 7B recipe with its layers compiled: at 7b fp32 and at 13b stochastic (fitted to mb 8)
        ("13b-stoch-compiled", "3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic",
                                                   "train.compile=true", "train.log_every=1",
                                                   "train.warmup_steps=1", "train.save_final=false",
                                                   "train.steps=4"]),
        ("7b-fp32-compiled", "3090-7b-offload", ["precision.master_dtype=fp32", "train.compile=true",
                                                 "train.log_every=1", "train.warmup_steps=1",
                                                 "train.save_final=false", "train.steps=5"]),
    ],
    # Issue 47: DPO on one H200 capped at 24 GiB by the presets, seq 1024, each beside SFT on rows of the same
    # length (benchmarks/sample_pairs.py) with the same sequences a step (SFT 12 rows, DPO 6 pairs; LoRA 8 and
    # 4): full fine-tuning on the 7B offload recipe and LoRA on the 7B LoRA recipe. tokens/s counts both rows
    # of a pair; full DPO's reference pass (before step 1) is its own figure (reference_s).
    "issue47": [
        (name, preset, ["data.seq_len=1024", "train.steps=6", "train.log_every=1", "train.warmup_steps=1",
                        "train.save_final=false", "train.grad_accum=1", *extra])
        for name, preset, extra in (
            ("7b-offload-sft", "3090-7b-offload", ["data.path=/tmp/sc-dpo-sft.jsonl", "train.micro_batch=12"]),
            ("7b-offload-dpo", "3090-7b-offload", ["data.path=/tmp/sc-dpo-pairs.jsonl", "train.objective=dpo",
                                                   "train.micro_batch=6"]),
            ("7b-lora-sft", "3090-7b-lora", ["data.path=/tmp/sc-dpo-sft.jsonl", "train.micro_batch=8"]),
            ("7b-lora-dpo", "3090-7b-lora", ["data.path=/tmp/sc-dpo-pairs.jsonl", "train.objective=dpo",
                                             "train.micro_batch=4"]))
    ],
    # Issue 45: the speed model (plan/speed/model.py) against runs that are not the presets as shipped, on
    # one H200 capped at 24 GiB, from an empty speeds file: model size, micro-batch, offload on/off, LoRA and
    # QLoRA, grad_accum, seq_len, compile, bf16 masters. Run with --plan: each row then carries plan --json's
    # predicted_tokens_per_s (plan_tokens_per_s) beside the measured (the fixed meter: per optimizer step).
    # Then the README rows that had grad_accum > 1, as shipped (the old meter printed them x2).
    # Walls of earlier calls: ~30 s a 1b run, ~50 s 7b LoRA, ~70 s 3b offload; about 9 minutes in all.
    "issue45": [
        (name, preset, [*sets, "train.save_final=false", "train.warmup_steps=1"])
        for name, preset, sets in (
            ("1b-seq4096-mb2", "3090-fsdp", ["data.seq_len=4096", "train.micro_batch=2", "train.steps=8",
                                             "train.log_every=1"]),
            ("125m-noshard-mb16", "ddp-baseline", ["memory.gpu_memory_limit=24GiB", "train.micro_batch=16",
                                                   "train.steps=24", "train.log_every=3"]),
            ("1b-ckpt-mb4-ga2-compiled", "h200-fsdp", ["memory.gpu_memory_limit=24GiB", "train.micro_batch=4",
                                                       "memory.activation_checkpointing=true", "train.grad_accum=2",
                                                       "train.steps=10", "train.log_every=2"]),
            ("1b-offload-bf16m-mb4-ga3", "3090-offload", ["precision.master_dtype=bf16", "train.grad_accum=3",
                                                          "train.steps=5", "train.log_every=1"]),
            ("1b-offload-mb8-noclip", "3090-offload", ["train.micro_batch=8", "train.clip_grad_norm=0",
                                                       "train.steps=6", "train.log_every=1"]),
            ("3b-adamw8bit-eager-mb3", "3090-3b-adamw8bit", ["train.compile=false", "train.micro_batch=3",
                                                             "train.steps=8", "train.log_every=1"]),
            ("7b-lora-mb2-seq1024", "3090-7b-lora", ["train.micro_batch=2", "data.seq_len=1024", "train.steps=8",
                                                     "train.log_every=1"]),
            ("7b-qlora-mb2-seq4096", "3090-7b-qlora", ["train.micro_batch=2", "data.seq_len=4096",
                                                       "train.grad_accum=1", "train.steps=6", "train.log_every=1"]),
            ("3b-offload-mb2-ga2", "3090-offload", ["model.name=3b", "train.micro_batch=2", "train.grad_accum=2",
                                                    "train.steps=4", "train.log_every=1"]),
            ("1b-selective-mb3", "3090-fsdp", ["memory.checkpoint_policy=selective", "train.micro_batch=3",
                                               "train.steps=8", "train.log_every=1"]),
            ("readme-3090-7b-lora", "3090-7b-lora", ["train.steps=6", "train.log_every=1"]),
            ("readme-3090-13b-qlora", "3090-13b-qlora", ["train.steps=5", "train.log_every=1"]),
        )
    ],
    # Issue 45, out of sample: settings neither the speed model's constants nor the issue45 rows were fitted on
    # (run after the refit of 2026-12-04), small models so that ten fit one short call, from an empty speeds file.
    "issue45-oos": [
        (name, preset, [*sets, "train.save_final=false", "train.warmup_steps=1", "train.log_every=1"])
        for name, preset, sets in (
            ("oos-1b-ckpt-mb2", "3090-fsdp", ["train.micro_batch=2", "train.steps=8"]),
            ("oos-1b-eager-nockpt-mb2", "h200-fsdp", ["train.compile=false", "memory.activation_checkpointing=false",
                                                      "train.micro_batch=2", "train.steps=8"]),
            ("oos-125m-seq2048-mb8", "ddp-baseline", ["data.seq_len=2048", "memory.gpu_memory_limit=24GiB",
                                                      "train.steps=16"]),
            ("oos-1b-offload-mb2", "3090-offload", ["train.micro_batch=2", "train.steps=5"]),
            ("oos-1b-lora-mb4", "3090-fsdp", ["train.method=lora", "train.steps=8"]),
            ("oos-3b-ckpt-mb2", "h200-fsdp", ["model.name=3b", "train.compile=false",
                                              "memory.activation_checkpointing=true", "train.micro_batch=2",
                                              "train.steps=6"]),
            ("oos-1b-bf16m-mb6", "3090-fsdp", ["precision.master_dtype=bf16", "train.micro_batch=6", "train.steps=8"]),
            ("oos-125m-ga4-mb4", "ddp-baseline", ["train.grad_accum=4", "train.micro_batch=4", "train.steps=12"]),
            ("oos-1b-seq1024-mb8-compiled", "h200-fsdp", ["data.seq_len=1024", "train.steps=10"]),
            ("oos-1b-offload-bf16m-mb6", "3090-offload", ["precision.master_dtype=bf16", "train.micro_batch=6",
                                                          "train.steps=5"]),
        )
    ],
    # Issue 45, out of sample again after the refit of 2026-12-04 evening (launch-bound eager micro-batches,
    # a per-step cost, LoRA's adapters by tokens): none of these settings was measured before.
    "issue45-oos2": [
        (name, preset, [*sets, "train.save_final=false", "train.warmup_steps=1", "train.log_every=1"])
        for name, preset, sets in (
            ("oos2-1b-compiled-ckpt-mb6", "h200-fsdp", ["memory.activation_checkpointing=true",
                                                        "train.micro_batch=6", "train.steps=8"]),
            ("oos2-3b-eager-mb2-ga2", "h200-fsdp", ["model.name=3b", "train.compile=false", "train.micro_batch=2",
                                                    "train.grad_accum=2", "train.steps=6"]),
            ("oos2-1b-zero3-mb4", "h200-fsdp", ["parallel.backend=deepspeed", "deepspeed.stage=3",
                                                "train.compile=false", "train.micro_batch=4", "train.steps=8"]),
            ("oos2-1b-qlora-mb8", "3090-7b-qlora", ["model.name=1b", "train.micro_batch=8", "train.grad_accum=1",
                                                    "train.steps=8"]),
            ("oos2-3b-offload-bf16m-mb6", "3090-offload", ["model.name=3b", "precision.master_dtype=bf16",
                                                           "train.micro_batch=6", "train.steps=4"]),
            ("oos2-125m-seq512-mb8-ga2", "ddp-baseline", ["data.seq_len=512", "train.grad_accum=2",
                                                          "train.steps=12"]),
            ("oos2-3b-adamw8bit-eager-mb5", "3090-3b-adamw8bit", ["train.compile=false", "train.micro_batch=5",
                                                                  "train.steps=6"]),
            ("oos2-1b-selective-compiled-mb4", "h200-fsdp", ["memory.activation_checkpointing=true",
                                                             "memory.checkpoint_policy=selective",
                                                             "train.micro_batch=4", "train.steps=8"]),
            ("oos2-7b-lora-seq1024-mb4", "3090-7b-lora", ["data.seq_len=1024", "train.micro_batch=4",
                                                          "train.grad_accum=1", "train.steps=6"]),
            ("oos2-1b-zero2-mb4", "h200-fsdp", ["parallel.backend=deepspeed", "deepspeed.stage=2",
                                                "train.compile=false", "train.micro_batch=4", "train.steps=8"]),
        )
    ],
    # Issue 45, out of sample a third time, after the DeepSpeed refit on issue45-oos2's ZeRO rows.
    "issue45-oos3": [
        (name, preset, [*sets, "train.save_final=false", "train.warmup_steps=1", "train.log_every=1"])
        for name, preset, sets in (
            ("oos3-1b-ckpt-mb3-ga2", "3090-fsdp", ["train.micro_batch=3", "train.grad_accum=2", "train.steps=6"]),
            ("oos3-1b-zero3-ckpt-mb6", "h200-fsdp", ["parallel.backend=deepspeed", "deepspeed.stage=3",
                                                     "train.compile=false", "memory.activation_checkpointing=true",
                                                     "train.micro_batch=6", "train.steps=8"]),
            ("oos3-3b-compiled-mb3", "h200-fsdp", ["model.name=3b", "train.micro_batch=3", "train.steps=6"]),
            ("oos3-1b-lora-seq1024-mb8", "3090-7b-lora", ["model.name=1b", "data.seq_len=1024", "train.micro_batch=8",
                                                          "train.grad_accum=1", "train.steps=8"]),
            ("oos3-1b-offload-noclip-mb4", "3090-offload", ["train.clip_grad_norm=0", "train.micro_batch=4",
                                                            "train.steps=5"]),
            ("oos3-3b-qlora-mb4", "3090-13b-qlora", ["model.name=3b", "train.micro_batch=4", "train.grad_accum=1",
                                                     "train.steps=6"]),
            ("oos3-125m-mb12", "ddp-baseline", ["train.micro_batch=12", "train.steps=12"]),
            ("oos3-1b-stochastic-eager-mb4", "h200-fsdp", ["train.compile=false", "precision.master_dtype=bf16",
                                                           "precision.master_rounding=stochastic",
                                                           "train.micro_batch=4", "train.steps=8"]),
            ("oos3-3b-zero2-ckpt-mb2", "h200-fsdp", ["model.name=3b", "parallel.backend=deepspeed", "deepspeed.stage=2",
                                                     "train.compile=false", "memory.activation_checkpointing=true",
                                                     "train.micro_batch=2", "train.steps=6"]),
            ("oos3-1b-seq4096-compiled-ckpt-mb2", "h200-fsdp", ["data.seq_len=4096", "memory.activation_checkpointing=true",
                                                                "train.micro_batch=2", "train.steps=8"]),
        )
    ],
    # Issue 48, first call: precision.fp8 on the 1b throughput preset (40 steps of the sample text, the same
    # seed and held-out records: the held-out loss against bf16's), and on the 7B offload recipe with fp32
    # masters beside the same preset without it.
    "issue48-fp8": [
        (f"1b-{fp8}", "h200-fsdp", ["data.path=/tmp/sc-lora-text.jsonl", "data.eval_fraction=0.02", "train.steps=40",
                                    "train.log_every=5", "train.save_final=false", f"precision.fp8={fp8}"])
        for fp8 in ("none", "tensorwise", "rowwise")
    ] + [
        (f"7b-fp32-{fp8}", "3090-7b-offload", ["precision.master_dtype=fp32", "train.log_every=1", "train.warmup_steps=1",
                                              "train.save_final=false", "train.steps=5", f"precision.fp8={fp8}",
                                              "data.path=/tmp/sc-lora-text.jsonl", "data.eval_fraction=0.02"])
        for fp8 in ("none", "tensorwise")
    ],
    # Issue 48's checks: memory.loss's default (fused on a GPU) beside the chunked loss on the paths the CPU
    # tests alone covered (DeepSpeed fp16 under a loss scale, LoRA and QLoRA's frozen head): the same loss
    # curve, the speed and memory; and fp8's held-out loss against bf16's own spread over seeds.
    "issue48-check": [
        *[(f"{tag}-{loss}", preset, ["train.steps=12", "train.log_every=1", "train.save_final=false",
                                     "data.path=/tmp/sc-lora-text.jsonl", f"memory.loss={loss}", *sets])
          for tag, preset, sets in (("z3-fp16", "4090x2-zero3", ["parallel.nproc_per_node=1"]),
                                    ("lora-1b", "3090-7b-lora", ["model.name=1b"]),
                                    ("qlora-1b", "3090-7b-qlora", ["model.name=1b"]))
          for loss in ("chunked", "auto")],
        *[(f"1b-{fp8}-seed{seed}", "h200-fsdp", ["data.path=/tmp/sc-lora-text.jsonl", "data.eval_fraction=0.02",
                                                 "train.steps=40", "train.log_every=5", "train.save_final=false",
                                                 f"precision.fp8={fp8}", f"train.seed={seed}"])
          for seed in (1, 2) for fp8 in ("none", "tensorwise")],
        # the 7B fp32 offload preset +- fp8 over 10 steps (the targets' rows run 5: too few to tell 5%)
        *[(f"7b-fp32-{fp8}-10", "3090-7b-offload", ["precision.master_dtype=fp32", "train.log_every=1",
                                                   "train.warmup_steps=1", "train.save_final=false", "train.steps=10",
                                                   f"precision.fp8={fp8}"])
          for fp8 in ("none", "tensorwise")],
        # fp8's casts are per weight, its saving per token: a larger micro-batch where the cap allows. The
        # planner put mb 14 at 22.9 GiB NVML (measured 22.1, 9,647 tokens/s, a step of 2.97 s, no longer than
        # mb 12's in bf16) and mb 16 at 23.7 (its last step 11.0k tokens/s by hand, memory not read)
        *[(f"7b-fp32-tensorwise-mb{mb}-10", "3090-7b-offload", ["precision.master_dtype=fp32", "train.log_every=1",
                                                                "train.warmup_steps=1", "train.save_final=false",
                                                                "train.steps=10", "precision.fp8=tensorwise",
                                                                f"train.micro_batch={mb}"])
          for mb in (14, 16)],
        # The 3b rows of earlier calls here (3b-adamw8bit-{preset,fp8}-10, 3b-adamw8bit-mb8-{bf16,fp8}-10, in
        # benchmarks/results/issue48/) had the settings of issue48-targets' 3b-adamw8bit-{preset,fp8} and
        # 3b-fp8-preset{-bf16,} (4090-3b-fp8 is the mb 8 recipe): `bash benchmarks/issue48_gpu.sh 3b` runs those.
    ],
    # fp8's numerics as it is used: a fine-tune from trained weights (issue48_gpu.sh ft-numerics first trains
    # and exports the base to /tmp/sc-48-base, holding out the same records), bf16 twice for its own spread.
    "issue48-ft": [
        (f"ft-{fp8}-{rep}", "h200-fsdp", ["model.name=/tmp/sc-48-base", "data.tokenizer=bytes",
                                          "data.path=/tmp/sc-lora-text.jsonl", "data.eval_fraction=0.02",
                                          "train.steps=40", "train.lr=2e-5", "train.warmup_steps=4",
                                          "train.log_every=5", "train.save_final=false",
                                          f"precision.fp8={fp8}"])
        for fp8, rep in (("none", "a"), ("tensorwise", "a"), ("none", "b"), ("tensorwise", "b"))
    ],
    # Issue 48's targets, each row beside the same preset without the change and its bare peer (run them a
    # target at a time with --only: one device call each; benchmarks/issue48_gpu.sh). 7B fp32 masters under
    # 24 GiB >= 10,000 tokens/s, 13B stochastic >= 5,500, 3b adamw8bit >= 24,000, 1b FSDP2 >= 72% MFU, 1b
    # ZeRO-3 >= 60% (MFU of the bf16 peak, fp8 or not). 13B's rows run 8 steps: the 7B's five-step rows
    # averaged the first steps in, which hid fp8's gain there, and the speed model plans 13B fp8 at the
    # launch's mb 9 at 5.3k tokens/s, near the target, where a short row could decide it wrongly.
    "issue48-targets": [
        *[(f"7b-fp32-{tag}", "3090-7b-offload", ["precision.master_dtype=fp32", "train.log_every=1", "train.warmup_steps=1",
                                                "train.save_final=false", "train.steps=5", *sets])
          for tag, sets in (("preset", []), ("fp8", ["precision.fp8=tensorwise"]),
                            ("fp8-fused", ["precision.fp8=tensorwise", "memory.loss=fused"]))],
        ("bare-7b-fsdp2-offload-mb12", "bare:fsdp2", ["--model", "7b", "--offload", "all", "--checkpointing",
                                                      "--gpu-memory-limit", "24", "--steps", "4", "--warmup", "2",
                                                      "--micro-batch", "12"]),
        *[(f"13b-stoch-{tag}", "3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic",
                                                  "train.log_every=1", "train.warmup_steps=1", "train.save_final=false",
                                                  "train.steps=8", *sets])
          for tag, sets in (("preset", []), ("fp8", ["precision.fp8=tensorwise"]))],
        ("bare-13b-fsdp2-offload-mb9", "bare:fsdp2", ["--model", "13b", "--offload", "all", "--checkpointing",
                                                      "--gpu-memory-limit", "24", "--steps", "3", "--warmup", "1",
                                                      "--micro-batch", "9", "--master-dtype", "bf16"]),
        *[(f"3b-adamw8bit-{tag}", "3090-3b-adamw8bit", ["train.steps=10", "train.warmup_steps=1",
                                                        "train.save_final=false", *sets])
          for tag, sets in (("preset", []), ("fp8", ["precision.fp8=tensorwise"]))],
        # the 3b target as shipped: 4090-3b-fp8 (fp8 at mb 8), and the same preset without fp8
        *[(f"3b-fp8-preset{tag}", "4090-3b-fp8", ["train.steps=10", "train.warmup_steps=1", "train.save_final=false",
                                                  *sets])
          for tag, sets in (("", []), ("-bf16", ["precision.fp8=none"]))],
        ("bare-3b-torchtune-adamw8bit-bwd-mb4", "bare:fsdp2",
         ["--model", "3b", "--micro-batch", "4", "--steps", "10", "--warmup", "4", "--master-dtype", "bf16",
          "--optim", "adamw8bit", "--step-in-backward", "--reduce-dtype", "bf16", "--checkpointing",
          "--gpu-memory-limit", "24"]),
        *[(f"1b-fsdp-{tag}", "h200-fsdp", ["train.steps=30", *sets])
          for tag, sets in (("preset", []), ("fp8", ["precision.fp8=tensorwise"]),
                            ("fp8-fused", ["precision.fp8=tensorwise", "memory.loss=fused"]),
                            ("fused", ["memory.loss=fused"]))],
        # the bare loop has no compile: MEASURED.md's bare FSDP2 1b compiled per layer was 71.0k (58.6%)
        ("bare-1b-fsdp2-mb8", "bare:fsdp2", ["--model", "1b", "--micro-batch", "8", "--steps", "30", "--warmup", "10"]),
        *[(f"1b-zero3-{tag}", "h200-fsdp", [s for s in Z3 if s not in ("train.compile=false", "train.steps=15")]
                                           + ["train.steps=30", *sets])
          for tag, sets in (("preset", []), ("fp8", ["precision.fp8=tensorwise"]))],
        ("bare-1b-zero3-mb8", "bare:deepspeed", ["--model", "1b", "--micro-batch", "8", "--steps", "30", "--warmup", "10"]),
    ],
    # Issue 59: a Llama-3.1-8B-shaped folder (benchmarks/model_folder.py llama3-8b /tmp/sc-llama3-8b, random
    # bf16 weights) through the 24 GiB recipes as a user runs them, beside the unchanged 7B preset.
    "issue59-8b": [
        *[(f"8b-{tag}", preset, [f"model.name={L3_8B}", "train.steps=8", "train.warmup_steps=1", *sets])
          for tag, preset, sets in (("lora", "3090-7b-lora", []), ("qlora", "3090-7b-qlora", []),
                                    # mb 12 chosen (as --set): the launch would fit a preset's own mb to the plan
                                    ("offload", "3090-7b-offload", ["train.save_final=none", "train.micro_batch=12"]),
                                    ("offload-fitted", "3090-7b-offload", ["train.save_final=none"]))],
        ("7b-lora-preset", "3090-7b-lora", ["train.steps=8", "train.warmup_steps=1"]),
    ],
    # Issue 62: long context on one 24 GiB card, llama3-8b (the catalog's Llama-3.1-8B shape, random init),
    # the layer inputs on the host (memory.activation_offload) and the MLP in 4,096-token tiles.
    "issue62-long": [
        (name, preset, ["model.name=llama3-8b", f"data.seq_len={seq}", "train.micro_batch=1", "train.grad_accum=1",
                        "memory.activation_checkpointing=true", "memory.activation_offload=true",
                        "memory.mlp_tile_tokens=4096", f"train.steps={steps}", "train.warmup_steps=1", "train.log_every=1",
                        "train.save_final=none"])
        # QLoRA at 64k is planned at 24 s a step: 6 steps keep the three in one 600 s device call
        for name, preset, seq, steps in (("8b-lora-32k", "3090-7b-lora", 32768, 10),
                                         ("8b-qlora-64k", "3090-7b-qlora", 65536, 6),
                                         ("8b-full-16k", "3090-7b-offload", 16384, 10))],
    # The second session: LoRA at 32k with the bf16 base offloaded (fsdp.cpu_offload: the frozen base streams
    # from the host under the GPU's long compute; on the GPU it ran out of memory), MLP tiles, no activation
    # offload; and QLoRA at 64k its 10 steps
    "issue62-second": [
        ("8b-lora-32k-offload", "3090-7b-lora", ["model.name=llama3-8b", "data.seq_len=32768", "train.micro_batch=1",
                                                 "train.grad_accum=1", "fsdp.cpu_offload=true",
                                                 "memory.activation_checkpointing=true", "memory.mlp_tile_tokens=4096",
                                                 "train.steps=10", "train.warmup_steps=1", "train.log_every=1",
                                                 "train.save_final=none"]),
        ("8b-qlora-64k", "3090-7b-qlora", ["model.name=llama3-8b", "data.seq_len=65536", "train.micro_batch=1",
                                           "train.grad_accum=1", "memory.activation_checkpointing=true",
                                           "memory.activation_offload=true", "memory.mlp_tile_tokens=4096",
                                           "train.steps=10", "train.warmup_steps=1", "train.log_every=1",
                                           "train.save_final=none"]),
    ],
    # Issue 61: GRPO on one 24 GiB card, generations 8 x max_new_tokens 256 (benchmarks/issue61_gpu.sh writes the
    # prompts and the reward file); a random-init model never samples its end token, so every completion is 256
    # tokens: the generation's worst case. LoRA / QLoRA at 8B, full at 1b and 3b (beta 0: no reference copy)
    "issue61-grpo": [
        (name, preset, [*model, "data.path=/tmp/sc-61-prompts.jsonl", "data.tokenizer=bytes", "data.seq_len=384",
                        "train.objective=grpo", "grpo.reward=/tmp/sc-61-rewards.py:score", "grpo.generations=8",
                        "grpo.max_new_tokens=256", f"train.micro_batch={mb}", "train.grad_accum=1", "train.steps=4",
                        "train.warmup_steps=1", "train.log_every=1", "train.save_final=none"])
        for name, preset, model, mb in (("8b-lora-grpo", "3090-7b-lora", ["model.name=llama3-8b"], 1),
                                        ("8b-qlora-grpo", "3090-7b-qlora", ["model.name=llama3-8b"], 1),
                                        ("1b-full-grpo", "3090-fsdp", [], 2),
                                        ("3b-full-grpo", "3090-3b-adamw8bit", [], 1))],
    # Issue 60: the consumer box's presets on the H200 capped at 24 GiB (the presets' own cap), each with its
    # host cap (memory.host_memory_limit: the run is held to it), beside today's preset for the same model where
    # one fits the 125 GiB host (3090-7b-offload: bf16 masters, 8 bytes a parameter). 8 steps each.
    "issue60-8b": [
        ("8b-64gb", "3090-8b-64gb", ["train.steps=8", "train.warmup_steps=1", "train.save_final=model",
                                     "train.export_dir=/tmp/sc-60-export-8b"]),
        ("8b-64gb-fp8", "3090-8b-64gb", ["train.steps=8", "train.warmup_steps=1", "train.save_final=none",
                                         "precision.fp8=tensorwise"]),
        ("8b-64gb-fp8-mb16", "3090-8b-64gb", ["train.steps=8", "train.warmup_steps=1", "train.save_final=none",
                                              "precision.fp8=tensorwise", "train.micro_batch=16"]),
        ("8b-today-7b-offload", "3090-7b-offload", ["model.name=llama3-8b", "train.steps=8", "train.warmup_steps=1",
                                                    "train.save_final=none", "train.micro_batch=12"]),
    ],
    "issue60-14b": [
        ("14b-96gb", "3090-14b-96gb", ["train.steps=7", "train.warmup_steps=1", "train.save_final=model",
                                       "train.export_dir=/tmp/sc-60-export-14b"]),
        ("14b-96gb-fp8", "3090-14b-96gb", ["train.steps=7", "train.warmup_steps=1", "train.save_final=none",
                                           "precision.fp8=tensorwise"]),
    ],
    "issue60-24b": [
        ("24b-128gb", "3090-24b-128gb", ["train.steps=7", "train.warmup_steps=1", "train.save_final=none"]),
        ("24b-128gb-fp8", "3090-24b-128gb", ["train.steps=7", "train.warmup_steps=1", "train.save_final=none",
                                             "precision.fp8=tensorwise"]),
    ],
    # The last call of the first session (14 minutes of device time left): the big two and the 8B again with
    # the arena locked after its shards moved in (the build's transient was the 8B's host peak)
    "issue60-final": [
        ("24b-128gb", "3090-24b-128gb", ["train.steps=5", "train.warmup_steps=1", "train.save_final=none"]),
        ("14b-96gb", "3090-14b-96gb", ["train.steps=6", "train.warmup_steps=1", "train.save_final=model"]),
        ("8b-64gb", "3090-8b-64gb", ["train.steps=6", "train.warmup_steps=1", "train.save_final=none"]),
    ],
    # The second session (the gradients in flight held to 4 units, fsdp.offload_grads_in_flight): 24B at larger
    # micro-batches (its step was the host's and the copies', not the GPU's), the 14B preset as shipped (saved,
    # exported), then the 8B preset saved and exported, beside no bound and fp8 at mb 14
    "issue60-big": [
        ("24b-mb6", "3090-24b-128gb", ["train.steps=5", "train.warmup_steps=1", "train.save_final=none",
                                       "train.micro_batch=6"]),
        ("24b-mb8-actoff", "3090-24b-128gb", ["train.steps=5", "train.warmup_steps=1", "train.save_final=none",
                                              "train.micro_batch=8", "memory.activation_offload=true"]),
        ("14b-96gb", "3090-14b-96gb", ["train.steps=6", "train.warmup_steps=1", "train.save_final=model",
                                       "train.export_dir=/tmp/sc-60-export-14b"]),
    ],
    # The one call the second session's device time allowed (15 minutes left after failed starts): the 14B
    # preset as shipped, saved and exported, then 24B at mb 8 with the layer inputs on the host
    "issue60-last": [
        ("14b-96gb", "3090-14b-96gb", ["train.steps=5", "train.warmup_steps=1", "train.save_final=model",
                                       "train.export_dir=/tmp/sc-60-export-14b"]),
        ("24b-mb8-actoff", "3090-24b-128gb", ["train.steps=4", "train.warmup_steps=1", "train.save_final=none",
                                              "train.micro_batch=8", "memory.activation_offload=true"]),
    ],
    "issue60-8b2": [
        ("8b-64gb", "3090-8b-64gb", ["train.steps=8", "train.warmup_steps=1", "train.save_final=model",
                                     "train.export_dir=/tmp/sc-60-export-8b"]),
        ("8b-64gb-nobound", "3090-8b-64gb", ["train.steps=6", "train.warmup_steps=1", "train.save_final=none",
                                             "fsdp.offload_grads_in_flight=0"]),
        ("8b-64gb-fp8-mb14", "3090-8b-64gb", ["train.steps=6", "train.warmup_steps=1", "train.save_final=none",
                                              "precision.fp8=tensorwise", "train.micro_batch=14"]),
    ],
    # adam-mini's numerics as it is used (issue48_gpu.sh ft-numerics' method): a 1b base trained and exported,
    # then fine-tuned 40 steps offloaded with fp32-master AdamW and with adam-mini, twice each (the spread: the
    # held-out records follow train.seed, so the seed stays; the GPU's nondeterministic kernels differ)
    "issue60-ft": [
        (f"ft-{name}-{rep}", "h200-fsdp", ["model.name=/tmp/sc-48-base", "data.tokenizer=bytes",
                                             "data.path=/tmp/sc-lora-text.jsonl", "data.eval_fraction=0.02",
                                             "train.steps=40", "train.lr=2e-5", "train.warmup_steps=4",
                                             "train.log_every=5", "train.save_final=none", "train.clip_grad_norm=0",
                                             "fsdp.cpu_offload=true", f"optim.name={name}"])
        for rep in ("a", "b") for name in ("adamw", "adam-mini")
    ],
    "quick": [
        ("h200-fsdp-nocompile", "h200-fsdp", ["train.steps=12", "train.compile=false", "train.log_every=2"]),
    ],
}


def summarize(run_dir: Path, warmup_frac: float = 0.34) -> dict:
    msgs = []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                msgs.append(decode(line))
            except ValueError:
                pass
    return summarize_messages(msgs)


def summarize_messages(msgs: list, warmup_frac: float = 0.34) -> dict:
    steps = [m for m in msgs if m.kind == "step"]
    mem = [m for m in msgs if m.kind == "memory"]
    gpu = [m for m in msgs if m.kind == "gpu"]
    host = [m for m in msgs if m.kind == "host"]
    failed = [m for m in msgs if m.kind == "failed"]
    offload = [m for m in msgs if m.kind == "offload" and m.rank == 0]
    keep = steps[int(len(steps) * warmup_frac):] or steps
    out = {
        "steps": len(steps),
        "tokens_per_s": statistics.median(m.tokens_per_s for m in keep) if keep else None,
        "mfu": statistics.median(m.mfu for m in keep) if keep and keep[0].mfu is not None else None,
        "step_s": statistics.median(m.step_s for m in keep) if keep else None,
        "last_loss": steps[-1].loss if steps else None,
        "eval_loss": next((m.loss for m in reversed(msgs) if m.kind == "eval"), None),
        # full DPO's reference pass before step 1 (backends/objective/preference.py's info line)
        "reference_s": next((float(m.detail.split(" in ")[1].split(" s")[0]) for m in msgs if m.kind == "event"
                             and m.name == "info" and "reference log-probs" in m.detail and " in " in m.detail
                             and "computed" in m.detail), None),
        "peak_reserved_gib": max((m.peak_reserved_bytes or 0) for m in mem) / 2**30 if mem else None,
        "peak_allocated_gib": max((m.peak_allocated_bytes or 0) for m in mem) / 2**30 if mem else None,
        "nvml_used_gib": max(m.used_bytes for m in gpu) / 2**30 if gpu else None,
        "host_used_gib": max(m.used_bytes for m in host) / 2**30 if host else None,
        "ranks_rss_gib": max(m.ranks_rss_bytes for m in host) / 2**30 if host else None,
        # the ranks' RSS from the first step on (the build's transients left out: which of the two set the peak)
        "ranks_rss_training_gib": (max((m.ranks_rss_bytes for m in host if steps and m.t >= steps[0].t), default=0)
                                   / 2**30 or None) if host else None,
        "failed": [f"{f.cause}: {f.message[:200]}" for f in failed],
        "warnings": [m.detail[:300] for m in msgs if m.kind == "event" and m.name == "warning"][:8],
        "loss_curve": [[m.step, round(m.loss, 4)] for m in steps],
        # the offload view's last line (GPU / host step / copies, verdict, its own cost): both backends
        "offload": ({k: v for k, v in vars(offload[-1]).items() if k not in ("v", "run", "t")}
                    if offload else None),
    }
    return out


def planned(preset: str, sets: list[str]) -> dict:
    """`shardconsole plan --json` for the same preset and --set values, on this machine: the figures the
    measured peaks are read against (GiB; allocated and the allocator's reserved, and NVML's)."""
    argv = [sys.executable, "-m", "shardconsole", "plan", "--preset", preset, "--json"]
    for s in sets:
        if not s.startswith("--"):
            argv += ["--set", s]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    try:
        doc = json.loads(res.stdout)
    except ValueError:
        return {"plan_error": (res.stderr or res.stdout)[-300:]}
    gib = lambda key: doc[key] / 2**30 if doc.get(key) is not None else None
    return {"plan_allocated_gib": gib("gpu_allocated_peak_bytes"), "plan_reserved_gib": gib("gpu_allocator_peak_bytes"),
            "plan_nvml_gib": gib("gpu_peak_bytes"), "plan_phase": doc.get("gpu_peak_phase"),
            "plan_tokens_per_s": doc.get("predicted_tokens_per_s"), "plan_bound": doc.get("bound"),
            "plan_host_gib": gib("host_peak_bytes"), "plan_fits": doc.get("fits"),
            "plan_parts_gib": {k: round(v / 2**30, 3) for k, v in (doc.get("gpu_parts") or {}).items()}}


def run_headless(preset: str, sets: list[str], root: Path, name: str, timeout: int) -> dict:
    run_dir = root / name
    argv = [sys.executable, "-m", "shardconsole", "--preset", preset, "--headless", "--run-dir", str(run_dir)]
    for s in sets:
        argv += [s] if s.startswith("--") else ["--set", s]     # a flag ("--force") as it is
    t0 = time.time()
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        rc, err = res.returncode, res.stderr[-1500:]
    except subprocess.TimeoutExpired:
        rc, err = "timeout", ""
    out = {"name": name, "preset": preset, "set": sets, "rc": rc, "wall_s": round(time.time() - t0, 1),
           **summarize(run_dir)}
    log = run_dir / "logs" / "rank0.log"
    if log.exists():     # what the rank said about its host memory (the arena's line) and the offload
        out["rank_log"] = [line[:300] for line in log.read_text(errors="replace").splitlines()
                           if any(k in line for k in ("host arena", "offload:", "lora:", "compile"))][:8]
    if rc != 0:
        out["stderr_tail"] = err
    # what the launch changed and said so (a micro-batch fitted to this GPU, say)
    out["notices"] = [line[:300] for line in err.splitlines() if line.startswith("shardconsole: train.")][:4]
    return out


def run_bare(preset: str, sets: list[str], root: Path, name: str, timeout: int) -> dict:
    """The same worker under torchrun, no front end, stream off: the bar for the console's overhead."""
    run_dir = root / (name + "-bare")
    run_dir.mkdir(parents=True)
    from shardconsole.settings import preset_store
    cfg = preset_store.load(preset, [s for s in sets if not s.startswith("--")])
    C.save(cfg, run_dir / "preset.toml")
    argv = build_argv(cfg, run_dir, run_dir.name)
    env = {**os.environ, "SHARDCONSOLE_STREAM": "off"}
    t0 = time.time()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    msgs = []
    for line in (run_dir / "logs" / "rank0.log").read_text().splitlines():
        if line.startswith('{"v"'):
            try:
                msgs.append(decode(line))
            except ValueError:
                pass
    return {"name": name + "-bare", "preset": preset, "set": sets, "rc": res.returncode,
            "wall_s": round(time.time() - t0, 1), **summarize_messages(msgs)}


def run_peer(engine: str, loop_args: list[str], name: str, timeout: int) -> dict:
    """A bare peer (benchmarks/bare_loops.py) under torchrun on one GPU; its BARE_RESULT line as a row."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            str(REPO / "benchmarks" / "bare_loops.py"), "--engine", engine, *loop_args]
    t0 = time.time()
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        rc, text, err = res.returncode, res.stdout, res.stderr[-1500:]
    except subprocess.TimeoutExpired as e:     # its output comes back as bytes even with text=True
        got = e.stdout or b""
        rc, text, err = "timeout", got.decode(errors="replace") if isinstance(got, bytes) else got, ""
    found = [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("BARE_RESULT ")]
    got = found[-1] if found else {}
    out = {"name": name, "preset": f"bare:{engine}", "set": loop_args, "rc": rc, "wall_s": round(time.time() - t0, 1),
           "tokens_per_s": got.get("tokens_per_s"), "mfu": None, "step_s": got.get("step_s"),
           "peak_reserved_gib": got.get("peak_reserved_gib"), "nvml_used_gib": got.get("nvml_peak_gib"),
           "host_used_gib": got.get("host_rss_gib"), "last_loss": got.get("loss_last"),
           "eval_loss": got.get("eval_loss"),
           "step_times": got.get("step_times"), "failed": [got["error"]] if "error" in got else []}
    if rc != 0:
        out["stderr_tail"] = err
    return out


def run_entry(name: str, preset: str, sets: list[str], root: Path, timeout: int, plan: bool = False) -> dict:
    if preset.startswith("bare:"):
        return run_peer(preset.split(":", 1)[1], sets, name, timeout)
    return {**run_headless(preset, sets, root, name, timeout), **(planned(preset, sets) if plan else {})}


def overlap_row(r: dict) -> str:
    """One row of the overlap table: the offload view's parts (rank 0's last line), how much of them the
    step hid, and the step against issue 35's bar (1.15 x the largest part, H2D and D2H counted together)."""
    o = r.get("offload") or {}
    gpu, host, h2d, d2h, step = (o.get(k) for k in ("gpu_s", "host_step_s", "h2d_s", "d2h_s", "step_s"))
    parts = [x for x in (gpu, host, (h2d or 0) + (d2h or 0)) if x is not None]
    ratio = step / max(parts) if step and parts else None
    total = sum(x or 0 for x in (gpu, host, h2d, d2h))
    hidden = max(0.0, total - step) / total if step and total else None
    host_hidden = (o["host_hidden_s"] / host if o.get("host_hidden_s") is not None and host else None)
    return (f"{r['name']:<24} {str(r['rc']):>4} {fmt(r.get('step_s'), '.3f'):>7} {fmt(gpu, '.3f'):>6} "
            f"{fmt(host, '.3f'):>6} {fmt(h2d, '.3f'):>6} {fmt(d2h, '.3f'):>6} {fmt(host_hidden, '.0%'):>8} "
            f"{fmt(hidden, '.0%'):>7} {fmt(ratio, '.2f'):>9} {fmt(r.get('tokens_per_s'), ',.0f'):>8}  "
            f"{o.get('overlap', '-')[:60]}")


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def markdown(results: list[dict]) -> str:
    """A results file's rows as a markdown table (the GPU scripts' logs and the issues quote it); a run
    that failed shows its first failure line, or its stderr's last line when it said none."""
    lines = ["| run | rc | tokens/s | NVML peak GiB | allocator reserved GiB | host GiB | held-out loss | failure |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        said = [*r.get("failed", []), *reversed(r.get("stderr_tail", "").splitlines())] if r.get("rc") else []
        why = next((ln.strip() for s in said for ln in str(s).splitlines() if ln.strip()), "")
        lines.append(f"| {r['name']} | {r.get('rc')} | {fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{fmt(r.get('nvml_used_gib'), '.1f')} | {fmt(r.get('peak_reserved_gib'), '.1f')} | "
                     f"{fmt(r.get('host_used_gib'), '.1f')} | {fmt(r.get('eval_loss'), '.4f')} | "
                     f"{why[:160].replace('|', '/')} |")
    return "\n".join(lines)


def against_plan(results: list[dict]) -> str:
    """A results file's rows (written with --plan) beside the plan's figures, a line a run: tokens/s, NVML
    and reserved GiB, host GiB, each with the plan's in brackets, and a failed run's first failure."""
    lines = []
    for r in results:
        f = lambda k, spec=".1f": fmt(r.get(k), spec)
        lines.append(f"{r['name']:<16} rc {r['rc']} steps {r.get('steps')} tok/s {f('tokens_per_s', ',.0f')} "
                     f"(plan {f('plan_tokens_per_s', ',.0f')}) NVML {f('nvml_used_gib')} (plan {f('plan_nvml_gib')}) "
                     f"reserved {f('peak_reserved_gib')} (plan {f('plan_reserved_gib')}) host {f('host_used_gib')} "
                     f"(plan {f('plan_host_gib')}) fits {r.get('plan_fits')} {(r.get('failed') or [''])[0][:200]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--matrix", default="issue2", choices=sorted(MATRICES))
    ap.add_argument("--only", nargs="*", default=None, help="names from the matrix")
    ap.add_argument("--out", default=None)
    ap.add_argument("--overhead", nargs="*", default=None, metavar="NAME",
                    help="also run these (all when none given) under bare torchrun with the stream off")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--overlap-table", action="store_true",
                    help="also print the offload view's parts and what the step hid (matrix issue35-overlap)")
    ap.add_argument("--plan", action="store_true", help="put `plan --json`'s GPU figures beside each run's peaks")
    ap.add_argument("--markdown", metavar="FILE.json", default=None,
                    help="print FILE.json's results (written by --out) as a markdown table; runs nothing")
    ap.add_argument("--against-plan", metavar="FILE.json", default=None,
                    help="print FILE.json's results (written by --out --plan) beside the plan's figures; runs nothing")
    ap.add_argument("--parallel", action="store_true",
                    help="start every run of the matrix at once (small runs sharing one GPU)")
    args = ap.parse_args()
    if args.markdown or args.against_plan:
        table = markdown if args.markdown else against_plan
        print(table(json.loads(Path(args.markdown or args.against_plan).read_text())["results"]))
        return
    matrix = MATRICES[args.matrix]
    if args.only:
        matrix = [m for m in matrix if m[0] in args.only]
    if args.list:
        for name, preset, sets in matrix:
            print(name, preset, " ".join(sets if ":" in preset else (f"--set {s}" for s in sets)))
        return
    root = Path(tempfile.mkdtemp(prefix="sc-bench-"))
    results = []
    if args.parallel:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(len(matrix)) as pool:
            results = list(pool.map(lambda m: run_entry(m[0], m[1], m[2], root, args.timeout, args.plan), matrix))
        for r in results:
            print(json.dumps(r), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "argv": sys.argv,
                                                  "results": results}, indent=1))
        matrix = []
    for name, preset, sets in matrix:
        results.append(run_entry(name, preset, sets, root, args.timeout, args.plan))
        print(json.dumps(results[-1]), flush=True)
        if args.overhead is not None and (not args.overhead or name in args.overhead) and ":" not in preset:
            results.append(run_bare(preset, sets, root, name, args.timeout))
            print(json.dumps(results[-1]), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "argv": sys.argv,
                                                  "results": results}, indent=1))
    print(f"\n{'run':<28} {'rc':>4} {'tok/s':>9} {'MFU':>6} {'step s':>7} {'peak rsv GiB':>12} "
          f"{'nvml GiB':>9} {'host GiB':>9}")
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        print(f"{r['name']:<28} {str(r['rc']):>4} {fmt(r['tokens_per_s'], ',.0f'):>9} {mfu:>6} "
              f"{fmt(r['step_s'], '.3f'):>7} {fmt(r['peak_reserved_gib'], '.1f'):>12} "
              f"{fmt(r['nvml_used_gib'], '.1f'):>9} {fmt(r['host_used_gib'], '.1f'):>9}")
    if args.overlap_table:
        print(f"\n{'run':<24} {'rc':>4} {'step s':>7} {'GPU s':>6} {'host s':>6} {'H2D s':>6} {'D2H s':>6} "
              f"{'host hid':>8} {'parts hid':>7} {'step/max':>9} {'tok/s':>8}  overlap")
        for r in results:
            print(overlap_row(r))
        print("targets: step/max <= 1.15; 7b-fp32 >= 5,500 tok/s; 13b-stoch >= 3,000 tok/s (overlap on)")


if __name__ == "__main__":
    main()
