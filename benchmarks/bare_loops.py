"""The bare peers of issue 17's speed targets: a training loop as a competent user writes it without
shardconsole, with FSDP2 or DeepSpeed ZeRO-3 on the same Llama shapes, so a preset's tokens/s can be
read against what the plain libraries give on the same GPU, cap and batch.

    torchrun --standalone --nproc_per_node 1 benchmarks/bare_loops.py --engine fsdp2 --model 3b \\
        --offload all --checkpointing --micro-batch 4 --steps 8 --warmup 2 --gpu-memory-limit 24

Rank 0 prints one line `BARE_RESULT {json}` at the end (benchmarks/gpu_runs.py reads it). A step that
runs out of memory prints that line with "error" and exits 1. Nothing here imports the product except
the size table (shardconsole.settings.models), so the shapes match the presets exactly.

On CPU ranks (gloo, the test box) it runs too, for checking: fp32 compute, nothing pinned.

The torchtune-style peer (issue 35): bf16 weights, torchao's low-bit AdamW, one optimizer a parameter
stepped in the backward pass by a post-accumulate-grad hook (torchtune's optimizer_in_bwd: no clip),
activation checkpointing, no offload, reduce-scatter in bf16:

    torchrun --standalone --nproc_per_node 1 benchmarks/bare_loops.py --engine fsdp2 --model 3b \
        --master-dtype bf16 --optim adamw8bit --step-in-backward --reduce-dtype bf16 --checkpointing \
        --micro-batch 2 --gpu-memory-limit 24 --data /tmp/sc-lora-text.jsonl --eval-fraction 0.02

--data trains on a JSON-lines file of {"text": ...} records read as UTF-8 bytes, EOS byte 0 after each
(as the product reads text for a catalog model), the held-out records chosen as the product chooses
them (numpy's permutation by --seed; the product's train.seed is 1234), and prints the held-out loss
after the last step. The product packs with document masks, this loop without: a close reading, not
the same number to the last digit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
# Imported before deepspeed.zero.Init patches tensor constructors: on CPU, Init otherwise fails with a
# "Signature mismatch ... new_tensor" TypeError (as the product's DeepSpeed rank notes).
import torch._dynamo  # noqa: F401
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # torchrun puts benchmarks/ first
from shardconsole.settings.models import CATALOG, resolve  # noqa: E402  (the size table only)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["fsdp2", "deepspeed"], required=True)
    ap.add_argument("--model", choices=sorted(CATALOG), default="tiny")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--offload", choices=["none", "optimizer", "all"], default="none",
                    help="all: parameters and optimizer on the CPU")
    ap.add_argument("--master-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: the model is built in bf16 and AdamW steps the bf16 parameters (fsdp2 only)")
    ap.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=False,
                    help="activation checkpointing per decoder layer")
    ap.add_argument("--gpu-memory-limit", type=float, default=None, metavar="GiB")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="pin offloaded host memory (GPU only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optim", choices=["adamw", "adamw8bit", "adamw4bit"], default="adamw",
                    help="adamw8bit/4bit: torchao's low-bit AdamW (fsdp2 only)")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="one optimizer a parameter, stepped by its post-accumulate-grad hook (torchtune)")
    ap.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--data", default=None, help="JSON lines of {\"text\": ...}, read as UTF-8 bytes")
    ap.add_argument("--eval-fraction", type=float, default=0.0)
    args = ap.parse_args(argv)
    if args.engine == "deepspeed" and (args.optim != "adamw" or args.step_in_backward):
        ap.error("--optim and --step-in-backward are for fsdp2")
    if args.step_in_backward and (args.grad_accum > 1 or args.offload != "none"):
        ap.error("--step-in-backward steps once a backward, on the GPU: --grad-accum 1, --offload none")
    if args.engine == "fsdp2" and args.offload == "optimizer":
        ap.error("FSDP2 offloads parameters, gradients and optimizer state together: use --offload all")
    if args.engine == "deepspeed" and args.master_dtype == "bf16":
        ap.error("--master-dtype bf16 is for fsdp2; the DeepSpeed peer keeps DeepSpeed's default fp32 masters")
    if args.warmup >= args.steps:
        ap.error("--warmup must leave at least one step to measure")
    return args


def llama_config(name: str):
    from transformers import LlamaConfig
    # The product's dict for that size (its LlamaConfig kwargs), SDPA attention as its default, no KV cache.
    return LlamaConfig(**resolve(name).config, use_cache=False, attn_implementation="sdpa")


class RssPeak:
    """The largest resident size of this process over the run. Sampled on a thread: the peaks of an
    offloaded step (optimizer state, pinned staging) fall inside a step, not between steps."""

    def __init__(self, every_s: float = 0.05):
        self.proc, self.peak, self.every_s = psutil.Process(), 0, every_s
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(self.every_s)

    def stop(self) -> int:
        self._stop.set()
        return max(self.peak, self.proc.memory_info().rss)


class NvmlPeak:
    """The most memory NVML says the GPU uses over the run (what the product's gpu samples show), sampled
    on a thread like RssPeak; None without NVML."""

    def __init__(self, index: int, every_s: float = 0.05):
        self.peak, self.every_s, self._stop = None, every_s, threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            self.handle, self.nvml = pynvml.nvmlDeviceGetHandleByIndex(index), pynvml
        except Exception:   # noqa: BLE001 - no NVML: no figure
            return
        self.peak = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
            self._stop.wait(self.every_s)

    def stop(self) -> float | None:
        self._stop.set()
        return None if self.peak is None else self.peak / 2**30


def text_windows(path: str, seq_len: int, eval_fraction: float, seed: int):
    """(train, held-out) windows of seq_len + 1 byte ids: records as UTF-8 bytes, EOS 0 after each, back to
    back; the held-out records picked as the product's token cache picks them."""
    import numpy as np
    with open(path, encoding="utf-8") as fh:
        texts = [json.loads(line)["text"] for line in fh if line.strip()]
    held = np.zeros(len(texts), dtype=bool)
    if eval_fraction:
        held[np.random.default_rng(seed).permutation(len(texts))[:max(1, round(len(texts) * eval_fraction))]] = True

    def pack(keep: bool):
        ids = np.frombuffer(b"".join(t.encode() + b"\0" for t, h in zip(texts, held) if h == keep), dtype=np.uint8)
        n = (len(ids) - 1) // seq_len
        return torch.from_numpy(np.stack([ids[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64))
    return pack(False), pack(True) if eval_fraction else None


@torch.no_grad()
def held_out_loss(model, windows: torch.Tensor, micro_batch: int, device: torch.device) -> float:
    """The mean token loss over the held-out windows (equal lengths: the mean of the batch means)."""
    total, n = 0.0, 0
    for i in range(0, len(windows), micro_batch):
        ids = windows[i:i + micro_batch, :-1].to(device)
        total += model(input_ids=ids, labels=ids).loss.item() * len(ids)
        n += len(ids)
    return total / n


# ---------------------------------------------------------------------------------------------------
# FSDP2

def build_fsdp2(args, config, device: torch.device):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM
    on_gpu = device.type == "cuda"
    # On the meta device: no rank ever holds the full model (13B is 26 GB even in bf16).
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if args.master_dtype == "bf16":
        model.to(torch.bfloat16)                  # shards born bf16: AdamW then steps bf16 parameters
    layers = model.model.layers
    if args.checkpointing:
        # torch's wrapper (non-reentrant), as FSDP2's own examples and torchtitan apply it: before sharding,
        # so each layer's all-gather is redone inside its recomputation.
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    kw = {}
    if on_gpu:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPE[args.reduce_dtype])
    if args.offload == "all":
        # Pinning needs CUDA; on CPU ranks the "offload" is a no-op move, kept so the path runs.
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=args.pin and on_gpu)
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    model.to_empty(device="cpu" if args.offload == "all" else device)
    init_weights(model, config.initializer_range, args.seed + dist.get_rank(), device)
    # Non-persistent buffers (the rotary frequencies) hold garbage after to_empty(): build them anew.
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    model.train()
    # Fused AdamW needs the parameters on the GPU; with offload the step runs on the host with torch's
    # default (foreach) AdamW, which is what a plain user of CPUOffloadPolicy gets.
    fused = on_gpu and args.offload == "none"
    make = lambda ps: make_optimizer(args, ps, fused)          # noqa: E731
    if not args.step_in_backward:
        return model, make(model.parameters())
    # torchtune's optimizer in backward (training.register_optim_in_bwd_hooks): one optimizer a parameter,
    # stepped and its gradient freed by a hook FSDP2 calls once the sharded gradient is assigned.
    optims = {p: make([p]) for p in model.parameters()}

    def step_one(p) -> None:
        optims[p].step()
        optims[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_one)
    return model, None


DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _torchao_view_dtype() -> None:
    """torchao 0.18 cannot compile its step over bf16 FSDP2 shards (no aten.view.dtype on its state
    subclasses; pytorch/ao PR 4216, open): the product's registration of it, the one thing this loop takes
    from the product besides the size table. Without it the bf16 low-bit peer fails at its first step."""
    from shardconsole.backends.optim.lowbit_optim import register_view_dtype
    register_view_dtype()


def make_optimizer(args, params, fused: bool):
    if args.optim == "adamw":
        return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=fused or None)
    from torchao.optim import AdamW4bit, AdamW8bit      # torchtune's low-bit choice, torchao's defaults
    _torchao_view_dtype()
    cls = AdamW8bit if args.optim == "adamw8bit" else AdamW4bit
    return cls(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)


@torch.no_grad()
def init_weights(model, std: float, seed: int, device: torch.device) -> None:
    """Llama's init on each rank's own shards: norms to one, matrices normal(0, std). Drawn on the compute
    device and copied: drawing 13B of host shards on the CPU takes minutes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        local = p.to_local()
        if local.dim() == 1:
            local.fill_(1.0)
        else:
            local.copy_(torch.empty(local.shape, dtype=local.dtype, device=device).normal_(0.0, std, generator=gen))


def fsdp2_step(model, opt, batches) -> float:
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        (loss / len(batches)).backward()
    if opt is None:               # stepped in the backward pass, no clip (torchtune's optimizer_in_bwd)
        return loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


# ---------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3

def ds_config(args, on_gpu: bool) -> dict:
    zero: dict = {"stage": 3}
    if args.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": args.pin}
    if args.offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": args.pin}
    opt_params = {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    if not on_gpu and args.offload == "none":
        opt_params["torch_adam"] = True       # FusedAdam is a CUDA op; on CPU ranks torch's AdamW
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},            # bf16 compute, fp32 masters: DeepSpeed's default
        # "AdamW" lets DeepSpeed pick: CPUAdam with the optimizer offloaded, FusedAdam on the GPU otherwise.
        "optimizer": {"type": "AdamW", "params": opt_params},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def build_deepspeed(args, config, device: torch.device):
    import deepspeed
    from transformers import LlamaForCausalLM
    cfg = ds_config(args, device.type == "cuda")
    # zero.Init partitions each module as it is built (onto the host with offload_param), as DeepSpeed's
    # docs do for models that do not fit one device.
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = LlamaForCausalLM(config)
    if args.checkpointing:
        model.gradient_checkpointing_enable()   # HF's per-layer checkpointing, its default arguments
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.train()
    return engine


def deepspeed_step(engine, batches) -> float:
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)                  # DeepSpeed scales by grad_accum itself
        engine.step()                          # steps the optimizer at the accumulation boundary only
    return loss.item()


# ---------------------------------------------------------------------------------------------------

def is_oom(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def report(result: dict) -> None:
    print("BARE_RESULT " + json.dumps(result), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    # DeepSpeed picks its accelerator once, at import: say which before anything imports it.
    os.environ["DS_ACCELERATOR"] = "cuda" if on_gpu else "cpu"
    if on_gpu:
        torch.cuda.set_device(device)
        if args.gpu_memory_limit:             # the cap the presets set (memory.gpu_memory_limit)
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_limit * 2**30 / total), device)
        # Offloaded gradients are CPU tensors: clipping's norm reduces them over gloo, not NCCL.
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rss = RssPeak()
    nvml = NvmlPeak(torch.cuda.current_device()) if on_gpu else None
    config = llama_config(args.model)
    train_w, eval_w = text_windows(args.data, args.seq_len, args.eval_fraction, args.seed) if args.data \
        else (None, None)
    base = {"engine": args.engine, "model": args.model, "args": vars(args)}
    losses, times = [], []
    try:
        if args.engine == "fsdp2":
            model, opt = build_fsdp2(args, config, device)
            step = lambda b: fsdp2_step(model, opt, b)              # noqa: E731
        else:
            if not on_gpu:
                # Test box only: DeepSpeed's CPU comm layer JIT-builds a shared-memory all-reduce at init
                # (about a minute on 2 cores) that ZeRO training never calls. GPU runs are untouched.
                import importlib
                importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
            import deepspeed
            deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
            engine = build_deepspeed(args, config, device)
            step = lambda b: deepspeed_step(engine, b)              # noqa: E731
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank)     # random tokens, fixed per rank
        order = torch.randperm(len(train_w), generator=gen) if train_w is not None else None
        for i in range(args.steps):
            if order is None:
                batches = [torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), generator=gen)
                           .to(device) for _ in range(args.grad_accum)]
            else:            # the text's windows in a shuffled order, wrapping around
                take = [order[(i * args.grad_accum * args.micro_batch + j) % len(order)]
                        for j in range(args.grad_accum * args.micro_batch)]
                ids = train_w[torch.stack(take), :-1].to(device)
                batches = list(ids.split(args.micro_batch))
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses.append(step(batches))       # .item() inside waits for the loss, the sync below for the step
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    except Exception as e:
        if not is_oom(e):
            raise
        line = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        report({**base, "error": line, "steps": len(times), "host_rss_gib": rss.stop() / 2**30})
        os._exit(1)      # not a clean shutdown: the peers may sit in a collective; torchrun ends them
    eval_loss = held_out_loss(model, eval_w, args.micro_batch, device) \
        if eval_w is not None and args.engine == "fsdp2" else None
    host_peak = rss.stop()
    step_s = statistics.median(times[args.warmup:])
    tokens = args.micro_batch * args.grad_accum * args.seq_len * world
    if rank == 0:
        report({**base, "tokens_per_s": tokens / step_s, "step_s": step_s, "steps": len(times),
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if on_gpu else None,
                "host_rss_gib": host_peak / 2**30, "loss_first": losses[0], "loss_last": losses[-1],
                "nvml_peak_gib": nvml.stop() if nvml else None, "eval_loss": eval_loss,
                "finite": all(math.isfinite(x) for x in losses), "step_times": [round(t, 4) for t in times]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
