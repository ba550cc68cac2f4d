"""DeepSpeed checkpoints: engine.save_checkpoint into the atomic step folders of checkpoints.py, with
each rank's RNG states and the data position beside DeepSpeed's own files, and a resume that reads
those files with torch.load(weights_only=True) instead of DeepSpeed's weights_only=False.

What DeepSpeed allows on resume (0.19.8, checked at stages 2 and 3): the ZeRO partitions load only at
the rank count that saved them; engine.load_checkpoint on another raises ZeRORuntimeException ("used
a DP world size of 2 but the current world size is 1"). Another rank count goes through DeepSpeed's
universal checkpoint: `python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state
--input_folder step_N/global_stepN --output_folder OUT` converts our checkpoints (the flag adds the
universal_checkpoint_info that Megatron-DeepSpeed writes and we do not), and a ds_config with
`"checkpoint": {"load_universal": true}` loads OUT; that load is not wired into shardconsole yet, so
resume refuses a different rank count with this advice before DeepSpeed is asked.
"""

from __future__ import annotations

from shardconsole.backends.checkpoint import checkpoints
from shardconsole.backends.rank import common
from shardconsole.backends.engine import trainstate


def save(r: common.Rank, engine, data: trainstate.Data, step: int) -> None:
    """engine.save_checkpoint into step_N.partial (DeepSpeed's own layout: global_stepN/, latest,
    zero_to_fp32.py) with each rank's RNG states beside it, made visible as step_N when every rank is done.
    Always a full checkpoint, train.save_final = "model" too: DeepSpeed keeps the master weights in the
    optimizer's partitions, which export-model merges from these files."""
    def write(tmp) -> dict[str, str]:
        # Under LoRA only what trains: the frozen base is the model folder's (or the seed's), unchanged.
        engine.save_checkpoint(str(tmp), tag=f"global_step{step}", client_state={"step": step},
                               exclude_frozen_parameters=r.cfg.adapters)
        checkpoints.write_rank_state(tmp, r.rank, {"rng": trainstate.rng_state(r.device)})
        return {}       # DeepSpeed writes its files itself: all hashed after, at the manifest

    checkpoints.run_save(r, step, checkpoints.SaveKind.CHECKPOINT, _estimated_bytes(r, engine), write,
                         {"samples_consumed": data.samples})
    if step < r.cfg.train.steps:
        r.phase("training")


def _estimated_bytes(r: common.Rank, engine) -> int:
    """The checkpoint's size for the progress line: the module in its dtype plus the master weights and
    Adam's two moments in the master dtype (DeepSpeed's files add a little)."""
    n = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    compute = 4 if r.cfg.precision.dtype == "fp32" else 2
    master = 2 if r.cfg.precision.master_dtype == "bf16" else 4
    return n * (compute + 3 * master)


def resume(r: common.Rank, engine, data: trainstate.Data) -> int:
    """Load the newest complete checkpoint; 0 when there is none. DeepSpeed needs the rank count it was
    saved with (a different one goes through its universal-checkpoint conversion, not wired here)."""
    checkpoints.remove_partials(r)
    found = checkpoints.newest_complete(r)
    if found is None:
        r.event("info", f"no checkpoint in {r.checkpoint_dir()}: starting from step 0")
        return 0
    saved_world = found.meta.get("world", r.world)
    if saved_world != r.world:
        raise checkpoints.CheckpointError(
            f"{found.path}: written by {saved_world} DeepSpeed rank(s), this run has {r.world}; DeepSpeed loads "
            f"ZeRO partitions only at the rank count that saved them (convert it with "
            f"`python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state` for another)")
    safe_checkpoint_loads(engine)
    try:
        load_path, client = engine.load_checkpoint(str(found.path), load_module_strict=not r.cfg.adapters)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise checkpoints.CheckpointError(f"{found.path}: cannot be read as a DeepSpeed checkpoint: "
                                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:600]) from e
    if load_path is None:
        raise checkpoints.CheckpointError(f"{found.path}: DeepSpeed found nothing to load")
    step = int((client or {}).get("step", found.step))
    own = checkpoints.read_rank_state(found.path, r.rank)
    if own is not None:
        trainstate.set_rng_state(own["rng"], r.device)
    data.seek(int(found.meta.get("samples_consumed", step * data.samples_per_step)))
    r.event("info", f"resumed from {found.path} (step {step})")
    return step


def safe_checkpoint_loads(engine) -> None:
    """DeepSpeed reads its checkpoint files with torch.load(weights_only=False): any pickle runs. Read
    them with weights_only=True, allowing only the DeepSpeed classes its own files hold."""
    import torch
    allowed = _deepspeed_safe_globals()
    ckpt_engine = engine.checkpoint_engine

    def load(path, map_location=None):
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    ckpt_engine.load = load


def _deepspeed_safe_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
