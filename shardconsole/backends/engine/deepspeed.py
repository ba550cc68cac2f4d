"""The DeepSpeed ZeRO rank's environment, ops and model: the engine that trains it (deepspeed.initialize,
steps, saves, resumes, exports) is ds_engine.py.

Stage 3 builds the model under deepspeed.zero.Init: each decoder module is partitioned as soon as it is
constructed, so no rank ever holds the whole model. Random init then fills each rank's partitions in
place; a local Hugging Face folder is loaded one tensor at a time by rank 0 into gathered parameters.
"""

from __future__ import annotations

import json
import os
from typing import Any
import re
import time
from pathlib import Path

import torch
# Must be imported before deepspeed.zero.Init patches tensor constructors, or Init fails on CPU with
# "TypeError: Signature mismatch between ... new_tensor ... and ... tensor_pynew" (docs/MEASURED.md).
import torch._dynamo  # noqa: F401

from shardconsole.backends.model import adapters, float8, modeling, qlora
from shardconsole.backends.rank import common
from shardconsole.backends.rank.jit_cache import clear_stale_lock, extension_dir
from shardconsole.settings.models import ModelError


# ---------------------------------------------------------------------------------------------------
# Environment, before DeepSpeed is imported or builds anything

_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([a-zA-Z]+)(\+PTX)?$")


def fix_cuda_arch_list(value: str) -> str | None:
    """TORCH_CUDA_ARCH_LIST that DeepSpeed's op builder can parse, or None when `value` is fine.

    Torch accepts arch-specific entries such as "9.0a" (sm_90a); DeepSpeed's builder does int() on the
    minor part and crashes ("invalid literal for int() with base 10: '0a'", docs/MEASURED.md). Its ops need
    no arch-specific instructions, so "9.0a" -> "9.0" (and "10.0a+PTX" -> "10.0+PTX") builds the same
    kernels for that card."""
    tokens = [t for t in value.replace(" ", ";").split(";") if t.strip()]
    out: list[str] = []
    changed = False
    for tok in tokens:
        tok = tok.strip()
        m = _ARCH_RE.match(tok)
        if m:
            tok = f"{m.group(1)}.{m.group(2)}{m.group(4) or ''}"
            changed = True
        if tok not in out:
            out.append(tok)
    return ";".join(out) if changed else None


def prepare_env(r: common.Rank) -> None:
    # DeepSpeed picks its accelerator once, at import; the rank's device decides it (CPU ranks on a box
    # with a GPU would otherwise get the CUDA accelerator).
    want = "cuda" if r.is_cuda else "cpu"
    os.environ["DS_ACCELERATOR"] = want
    value = r.knobs.cuda_arch_list
    fixed = fix_cuda_arch_list(value) if value else None
    if fixed is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
        r.event("info", f"TORCH_CUDA_ARCH_LIST={value!r} set to {fixed!r} for this run: DeepSpeed's op builder "
                        "cannot parse arch-specific entries such as 9.0a")


def allow_cpu_fp16(r: common.Rank) -> None:
    """DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels (AVX512-FP16 / AMX). Torch
    runs fp16 on any CPU through its generic kernels, slowly; the loss scaling is DeepSpeed's own code
    either way. CPU ranks exist to check runs cheaply, so fp16 is allowed there, with a warning."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.is_fp16_supported():
        return
    acc.is_fp16_supported = lambda: True
    r.event("warning", "fp16 on a CPU without oneDNN fp16 kernels: DeepSpeed's loss scaling runs as on a GPU, "
                       "the math runs on torch's slow generic kernels (for checks, not for speed)")


# ---------------------------------------------------------------------------------------------------
# Ops that may be compiled on first use (JIT, cached in TORCH_EXTENSIONS_DIR)

def skip_shm_comm_op() -> None:
    """On a CPU accelerator DeepSpeed's comm layer JIT-builds a shared-memory all-reduce op at init (62 s
    on 2 cores, once per machine). Only its inference all-reduce (tensor-parallel layers) uses it, and
    that falls back to torch.distributed's all_reduce without it: ZeRO training never calls it."""
    import importlib
    # Not `import deepspeed.comm.torch`: deepspeed.comm's attribute `torch` is the torch package.
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_torch, "build_shm_op"):
        setattr(ds_torch, "build_shm_op", lambda: None)


def build_ops(r: common.Rank, ds_cfg: dict) -> None:
    """Everything that can JIT-compile, up front and under its own phase, so a 30-60 s first build shows
    as "building ops" rather than as a hang: the optimizer's op (CPUAdam when offloaded, FusedAdam on a
    GPU; none for torch's AdamW). DeepSpeed's CPU comm op is skipped (skip_shm_comm_op)."""
    r.phase("building ops")
    t0 = time.perf_counter()
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    if not r.is_cuda:
        skip_shm_comm_op()
    common.init_process_group(r)     # our timeout and device binding; DeepSpeed wraps this group
    deepspeed.init_distributed(dist_backend="nccl" if r.is_cuda else "gloo")
    names = []
    params = ds_cfg["optimizer"]["params"]
    if not params.get("torch_adam"):
        offload = ds_cfg["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none"
        name = "CPUAdamBuilder" if offload else "FusedAdamBuilder"
        builder = get_accelerator().create_op_builder(name)
        label = name.replace("Builder", "")
        so = extension_dir(builder.name) / f"{builder.name}.so"
        before = so.stat().st_mtime if so.exists() else None
        # Said before the build, so the front end can show what is being built, and where, while it waits.
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get(builder.name, False):      # built into DeepSpeed at install (DS_BUILD_OPS=1)
            r.event("op_build", f"{label}: prebuilt with DeepSpeed, no JIT build")
        else:
            r.event("op_build", f"{label} (JIT) in {so.parent}: " + (
                "cached, reused unless its flags changed" if before is not None else
                "not built yet: compiling, minutes on a few cores"))
        _clear_stale_lock(r, builder.name)
        t1 = time.perf_counter()
        builder.load(verbose=False)
        built = so.exists() and so.stat().st_mtime != before
        names.append(f"{label} {'built' if built else 'cached'} in {time.perf_counter() - t1:.1f} s")
    names += _build_async_io(r, ds_cfg)
    where = extension_dir("")
    r.event("info", f"DeepSpeed ops ready in {time.perf_counter() - t0:.1f} s "
                    f"({', '.join(['comm'] + names)}; JIT builds are cached in {where})")


def _clear_stale_lock(r: common.Rank, name: str) -> None:
    """A killed build's lock would make this load wait forever (jit_cache.clear_stale_lock)."""
    import psutil
    why = clear_stale_lock(name, psutil.Process().create_time())
    if why:
        r.event("warning", why, all_ranks=True)


def _build_async_io(r: common.Rank, ds_cfg: dict) -> list[str]:
    """NVMe offload swaps through DeepSpeed's async I/O op (libaio), built on first use deep inside the
    engine. Built here instead, under "building ops"; a machine that cannot build it is one line naming
    the setting, before the model is loaded."""
    zo = ds_cfg["zero_optimization"]
    keys = [k for k in ("offload_optimizer", "offload_param") if zo.get(k, {}).get("device") == "nvme"]
    if not keys:
        return []
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        raise ModelError(f"deepspeed.{keys[0]} = \"nvme\" needs DeepSpeed's async I/O op, which cannot be built on "
                         "this machine (libaio's headers are missing: apt install libaio-dev); use \"cpu\"")
    t1 = time.perf_counter()
    _clear_stale_lock(r, builder.name)
    builder.load(verbose=False)
    return [f"AsyncIO ready in {time.perf_counter() - t1:.1f} s"]


# ---------------------------------------------------------------------------------------------------
# The model

def _weight_files(folder: Path) -> list[Path]:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            return [folder / s for s in shards]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return [folder / single]
    raise ModelError(f"{folder}: no weights (model.safetensors or pytorch_model.bin)")


class _Weights:
    """The tensors of a Hugging Face folder by name, read one at a time when asked for (safetensors
    and torch.load(mmap=True) map the files), so rank 0 never holds the whole model either."""

    def __init__(self, folder: Path) -> None:
        self.handles: dict[Path, Any] = {}
        self.where: dict[str, Path] = {}
        for f in _weight_files(folder):
            if f.suffix == ".safetensors":
                from safetensors import safe_open
                handle = safe_open(str(f), framework="pt")
                names = list(handle.keys())
            else:
                handle = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
                names = list(handle)
            self.handles[f] = handle
            self.where.update((n, f) for n in names)

    def get(self, name: str) -> torch.Tensor:
        handle = self.handles[self.where[name]]
        return handle.get_tensor(name) if hasattr(handle, "get_tensor") else handle[name]


@torch.no_grad()
def load_pretrained_partitions(r: common.Rank, model: modeling.CausalLMLoss) -> None:
    """Fill ZeRO-3 partitions from a Hugging Face folder: per parameter, gather it (empty but shaped),
    let rank 0 copy the file's tensor in, and re-partition on exit (GatheredParameters, modifier 0)."""
    import deepspeed
    params = dict(model.lm.named_parameters())
    # Every rank opens the index (no tensor is read), so a folder that lacks weights fails everywhere
    # at once instead of leaving ranks 1.. waiting in the first gather.
    assert r.spec.path is not None      # a folder with weights: build() loads partitions only then
    weights = _Weights(Path(r.spec.path))
    missing = sorted(set(params) - set(weights.where))
    if missing:
        raise ModelError(f"{r.spec.path}: weights lack {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    for name, p in params.items():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if r.rank == 0:
                p.data.copy_(weights.get(name).to(p.dtype))


@torch.no_grad()
def init_partitions_(model: torch.nn.Module, std: float, seed: int, rank: int,
                     reference: modeling.Reference | None = None) -> None:
    """modeling.init_random_ for ZeRO-3: the same rules (normal(0, std) matrices, vectors the model's own
    starting value) applied to each rank's own partition (p.ds_tensor), seeded per rank."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 7919 + rank)
    for name, p in model.named_parameters():
        local = p.ds_tensor
        if local.numel() == 0:
            continue
        value = modeling.vector_value(reference, name, len(p.ds_shape))
        if value is not None:
            local.fill_(value)
        else:
            local.copy_(torch.empty(local.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))


@torch.no_grad()
def init_as_partitions_(model: torch.nn.Module, std: float, seed: int, world: int,
                        reference: modeling.Reference | None = None) -> None:
    """Stages 0-2 (a full copy on every rank): the values init_partitions_ gives under ZeRO-3, drawn
    partition by partition (ceil(numel / world) elements each, as DeepSpeed splits a flattened
    parameter), so one seed is one model at every stage and stages compare step for step."""
    gens = [torch.Generator(device="cpu").manual_seed(seed * 7919 + k) for k in range(world)]
    for name, p in model.named_parameters():
        value = modeling.vector_value(reference, name, p.dim())
        if value is not None:
            p.fill_(value)
        else:
            flat = p.view(-1)
            part = -(-flat.numel() // world)
            for k, gen in enumerate(gens):
                values = torch.empty(part, dtype=torch.float32).normal_(0.0, std, generator=gen)
                lo = k * part
                n = max(0, min(part, flat.numel() - lo))
                flat[lo:lo + n].copy_(values[:n])


def _build_partitioned(hf_cfg, ds_cfg: dict) -> torch.nn.Module:
    """The LM built under zero.Init. transformers' init zeroes the embedding's padding row
    (weight[pad_token_id]) after zero.Init has already partitioned that weight to an empty tensor: an
    IndexError on every model whose config names a pad token. So it is built without one, and the
    embedding gets its padding_idx back for forward and backward (the row's values come from the
    checkpoint or from init_partitions_)."""
    import deepspeed
    pad = getattr(hf_cfg, "pad_token_id", None)
    hf_cfg.pad_token_id = None
    try:
        with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
            lm = modeling.build_causal_lm(hf_cfg)
    finally:
        hf_cfg.pad_token_id = pad
    embed = lm.get_input_embeddings()
    if pad is not None and isinstance(embed, torch.nn.Embedding):
        embed.padding_idx = pad
    return lm


def build(r: common.Rank, ds_cfg: dict, hf_cfg, reference: modeling.Reference) -> modeling.CausalLMLoss:
    """The model under ZeRO; `reference` (modeling.Reference of hf_cfg) starts a random init's vectors, and
    the engine restores the buffers from the same one after deepspeed.initialize."""
    import deepspeed
    r.phase("loading model")
    cfg = r.cfg
    pretrained = r.spec.path is not None and r.spec.has_weights
    std = float(getattr(hf_cfg, "initializer_range", 0.02))
    if cfg.train.method == "qlora":
        model = qlora.build(r, hf_cfg)        # the 4-bit base replicated (stages 0-2), adapters on it
        lm = model.lm
    elif cfg.deepspeed.stage == 3:
        # Init takes the dtype (fp16 / bf16 / fp32) and the offload_param placement from ds_cfg. No dtype=
        # argument: DeepSpeed 0.19 reads `dtype or fp16 if fp16_supported else bf16` so, on a CPU without
        # fp16, dtype=torch.float32 builds bf16 parameters; only the config path gets fp32 right.
        lm = _build_partitioned(hf_cfg, ds_cfg)
        model = modeling.CausalLMLoss(lm, loss=cfg.memory.loss_on(r.is_cuda))
        # The loss reads lm_head.weight directly (chunked or fused cross-entropy), outside lm_head's forward:
        # ZeRO-3 must gather it for the root module's forward and backward.
        deepspeed.zero.register_external_parameter(model, lm.lm_head.weight)
        if pretrained:
            load_pretrained_partitions(r, model)
        else:
            init_partitions_(model, std, cfg.train.seed, r.rank, reference)
    else:
        # Stages 0-2 keep a full copy of the parameters on every rank by design; every rank draws the
        # same values (and DeepSpeed broadcasts rank 0's at initialize anyway).
        lm = modeling.load_pretrained(r.spec, hf_cfg) if pretrained else modeling.build_causal_lm(hf_cfg)
        model = modeling.CausalLMLoss(lm, loss=cfg.memory.loss_on(r.is_cuda))
        if not pretrained:
            init_as_partitions_(model, std, cfg.train.seed, r.world, reference)
    if cfg.train.method == "lora":
        # After the base weights are in (ZeRO-3: into partitions): the adapters are new parameters,
        # which deepspeed.initialize partitions like the rest.
        adapters.inject(lm, cfg)
        adapters.init_adapters_(model, cfg.train.seed, r.rank)
        r.log(f"{cfg.train.method}: {adapters.count_line(model)}")
        if cfg.deepspeed.stage == 3:
            # With a frozen embedding the first decoder layer's input needs no gradient, so ZeRO-3's
            # backward hook on that layer never fires and its partitions are used ungathered ("size of
            # tensor a (0) must match"); an embedding output that asks for a gradient fires it (transformers'
            # own remedy for frozen bases, as with peft and activation checkpointing).
            lm.enable_input_require_grads()
    if cfg.precision.fp8 != "none":
        # Float8Linear keeps each nn.Linear's parameter (ZeRO-3's partition included): converted in place
        # before deepspeed.initialize hooks the modules. DeepSpeed gathers bf16 (no float8 all-gather).
        float8.convert_for_rank(r, modeling.decoder_layers(lm), all_gather=False)
    per_layer = cfg.compiles_layers
    if cfg.deepspeed.stage == 3 and cfg.deepspeed.stage3_layer_gather:
        # Hooks on the decoder layer only, none on its Linears and norms: ZeRO-3 fetches the whole layer
        # at its pre-forward hook (as FSDP2's per-layer unit does) instead of running ~9 hook pairs a
        # layer in Python, and the layer body is free of hooks so it can be compiled.
        from deepspeed.utils import set_z3_leaf_modules
        set_z3_leaf_modules(model, [type(modeling.decoder_layers(lm)[0])])
    if cfg.memory.activation_checkpointing:
        modeling.apply_checkpointing(model.lm, cfg.memory.checkpoint_policy, compiled=per_layer)
    if per_layer:
        for layer in modeling.decoder_layers(lm):
            # The forward, not __call__: DeepSpeed's hooks stay outside the compiled graph.
            layer.forward = torch.compile(layer.forward)
    model.train()
    return model


# ---------------------------------------------------------------------------------------------------
# Loss scale (checkpoints: ds_checkpoint.py)

def loss_scale(engine) -> float | None:
    """The dynamic loss scale in force (fp16 only): ZeRO optimizers expose cur_scale, DeepSpeed's plain
    fp16 optimizer a loss_scale_config."""
    opt = engine.optimizer
    scfg = getattr(opt, "loss_scale_config", None)
    value = scfg.cur_scale if scfg is not None else getattr(opt, "cur_scale", None)
    return float(value) if value is not None else None
