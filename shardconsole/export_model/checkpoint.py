"""Reading a run's checkpoint for export: which step folder, and the model's weights in it, in one
process without a process group or the run's world size. Only the model entries: the optimizer, data
position and RNG states stay where they are."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from shardconsole.runlog.checkpoint_files import checksums, safe_reason, step_folders, why_corrupt, why_incomplete
from shardconsole.settings import config as C
from shardconsole.settings.models import ModelError, ModelSpec

# The ranks train CausalLMLoss(lm): every checkpoint key is the Hugging Face model's own key under "lm.".
PREFIX = "lm."


class ExportError(ModelError):
    """One line for the user: the CLI prints it after `shardconsole: error:` and exits 2."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    kind: str          # "dcp" (FSDP2) or "deepspeed"


# ---------------------------------------------------------------------------------------------------
# Finding the checkpoint

def pick_checkpoint(root: Path, step: int | None, backend: str) -> Checkpoint:
    """The newest complete checkpoint, or the one of `step`; complete as resume judges it (the manifest's
    files all there at their sizes: runlog/checkpoint_files.why_incomplete)."""
    kind = "dcp" if backend == "fsdp" else "deepspeed"
    folders = step_folders(root)
    if not folders:
        raise ExportError(f"{root}: no checkpoint to export (a run writes one at the end with "
                          f"train.save_final = \"full\" or \"model\", or every train.checkpoint_every steps)")
    if step is not None and step not in dict(folders):
        steps = ", ".join(str(n) for n, _ in folders[:8])
        raise ExportError(f"--step {step}: no checkpoint of that step in {root} (steps there: {steps})")
    if step is not None:
        path = dict(folders)[step]
        why = _why_unusable(path, backend)
        if why:
            raise ExportError(f"--step {step}: {path} is not a complete checkpoint: {why}")
        return Checkpoint(step, path, kind)
    for n, path in folders:
        why = _why_unusable(path, backend)
        if why is None:
            return Checkpoint(n, path, kind)
        print(f"shardconsole: skipping {path}: {why}; trying the one before", file=sys.stderr)
    raise ExportError(f"{root}: no complete checkpoint to export (every step folder there is incomplete)")


def _why_unusable(path: Path, backend: str) -> str | None:
    """why_incomplete, then every file against its checksum (a block changed in place loads as NaN
    weights otherwise); a checkpoint saved before checksums is exported unverified, said so."""
    why = why_incomplete(path, backend) or why_corrupt(path)
    if why is None and checksums(path) is None:
        print(f"shardconsole: {path} has no checksums (saved before shardconsole wrote them): exported unverified",
              file=sys.stderr)
    return why


def check_finite(state: dict, ckpt: Checkpoint) -> None:
    """Refuse weights that hold NaN or inf: a model folder that loads and answers garbage is worse than
    no folder. (A checkpoint damaged after its save fails its checksum first; this is a run that
    diverged before it saved.)"""
    import torch
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ExportError(f"{ckpt.path}: the weight {name} holds NaN or inf (the run had diverged by step "
                              f"{ckpt.step}); export an earlier checkpoint with --step N")


# ---------------------------------------------------------------------------------------------------
# Reading the model's weights

@contextlib.contextmanager
def _no_code_from_pickles(allowed: list):
    """Every torch.load inside (DeepSpeed's zero_to_fp32 passes weights_only=False itself) builds only
    tensors, containers and the `allowed` classes: a crafted checkpoint file cannot run code."""
    import torch.serialization
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


def read_model_state(ckpt: Checkpoint) -> dict:
    """The trained weights under the Hugging Face model's own key names, as the checkpoint keeps them
    (fp32 or bf16 master weights)."""
    try:
        raw = _read_dcp(ckpt.path) if ckpt.kind == "dcp" else _read_deepspeed(ckpt.path)
    except (ExportError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:     # DCP's CheckpointException is a BaseException
        # damaged or foreign files fail deep inside torch or DeepSpeed: one line, not a traceback
        raise ExportError(f"{ckpt.path}: cannot read the checkpoint ({_first_cause(e)})") from None
    bad = [k for k in raw if not k.startswith(PREFIX)]
    if bad or not raw:
        raise ExportError(f"{ckpt.path}: not a shardconsole model checkpoint (expected every weight under "
                          f"{PREFIX!r}, found {bad[0] if bad else 'no weights'!r})")
    return {k[len(PREFIX):]: v for k, v in raw.items()}


def _first_cause(e: BaseException) -> str:
    """DCP wraps each rank's failure ({rank: (exception, frames)}); the user needs the first one's line."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    text = str(e).strip()
    if "weights_only" in text or "Weights only load failed" in text:
        return safe_reason(f"{type(e).__name__}: {text}")     # never torch's advice to load it unsafely
    lines = text.splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _read_dcp(path: Path) -> dict:
    """FSDP2's torch.distributed.checkpoint, read whole in this process: DCP reassembles each tensor from
    however many ranks wrote it, so neither the world size nor a process group is needed. Only the
    "model" entries; the .metadata pickle through the ranks' own restricted reader."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from shardconsole.backends.engine.fsdp_step import SafeReader
    with warnings.catch_warnings(), _no_code_from_pickles([]):
        # "torch.distributed is unavailable or uninitialized, assuming ... a single process": that is the point
        warnings.simplefilter("ignore")
        state = _load_state_dict_from_keys({"model"}, storage_reader=SafeReader(str(path)))
    model = state.get("model")
    if not isinstance(model, dict):
        raise ExportError(f"{path}: this DCP checkpoint holds no 'model' entry (was it written by shardconsole?)")
    return model


def _read_deepspeed(path: Path) -> dict:
    """engine.save_checkpoint's layout. Stages 1-3 keep the master weights partitioned in the optimizer
    files, merged by DeepSpeed's zero_to_fp32 (with bf16 masters, bf16_master_weights_and_grads, the
    "fp32" groups it reads are those bf16 masters, returned as they are). zero_to_fp32 fails on stage 0
    (no partitioned masters): in fp32 the module's own weights are what the optimizer updates; in bf16
    or fp16 the fp32 masters sit in the optimizer's state inside the model states file."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")     # merging runs on the host; no GPU is touched
    try:
        import torch
        from deepspeed.utils import zero_to_fp32
    except ImportError as e:
        raise ExportError(f"{path}: a DeepSpeed checkpoint; reading it needs the deepspeed package ({e})") from None
    tag = (path / "latest").read_text().strip()
    folder = path / tag
    states = sorted(folder.glob("*model_states.pt"))
    if not states:
        raise ExportError(f"{folder}: no *model_states.pt file: the DeepSpeed checkpoint is incomplete")
    allowed = _deepspeed_classes()
    with _no_code_from_pickles(allowed):
        meta = torch.load(states[0], map_location="cpu", weights_only=True, mmap=True)
    ds_cfg = meta.get("ds_config") or {}
    stage = int((ds_cfg.get("zero_optimization") or {}).get("stage", 0))
    half = [k for k in ("bf16", "fp16") if (ds_cfg.get(k) or {}).get("enabled")]
    if stage == 0:
        return _stage0_masters(meta, folder, half[0]) if half else dict(meta["module"])
    # zero_to_fp32 prints its progress on stdout and draws tqdm bars on stderr: the command's own output is
    # one line, and an error still surfaces as the exception it raises.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            _no_code_from_pickles(allowed):
        try:
            return dict(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag))
        except (ValueError, FileNotFoundError) as e:
            raise ExportError(f"{folder}: DeepSpeed cannot merge this ZeRO-{stage} checkpoint: {e}") from None


def _deepspeed_classes() -> list:
    """The classes DeepSpeed's own checkpoint files hold besides tensors (the ranks' resume allows the same)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _stage0_masters(meta: dict, folder: Path, half: str) -> dict:
    """Stage 0 in bf16/fp16: DeepSpeed's (B)F16 optimizer keeps one fp32 master per parameter in
    `fp32_groups`, in the module's parameter order, without names. The order is trusted only when every
    master has its parameter's shape and rounds to exactly the half-precision weight the module holds."""
    import torch
    module = meta["module"]
    names = [k for k in module if k not in set(meta.get("buffer_names") or ())]
    groups = (meta.get("optimizer") or {}).get("fp32_groups")
    masters = [t for group in groups for t in group] if isinstance(groups, list) else []
    if len(masters) != len(names) or not all(
            isinstance(t, torch.Tensor) and t.shape == module[n].shape and torch.equal(t.to(module[n].dtype), module[n])
            for t, n in zip(masters, names)):
        raise ExportError(f"{folder}: DeepSpeed stage 0 in {half}: the fp32 master weights in its optimizer state "
                          f"do not map onto the model's parameters; export from a checkpoint of deepspeed.stage "
                          f"1-3 or FSDP2")
    return dict(zip(names, masters))


def check_exportable(cfg: C.RunConfig, spec: ModelSpec, adapter_only: bool, source: Path) -> None:
    """The refusals known from the settings alone, before anything is read or imported (torch and peft
    take seconds to import: `--adapter` of a full run was refused after 9 s)."""
    if adapter_only and not cfg.adapters:
        raise ExportError(f"--adapter: {source} trained every weight (train.method = \"full\"); there is no "
                          f"adapter to export: leave --adapter out for the full model")
    if cfg.adapters and (spec.path is None or not spec.has_weights):
        raise ExportError(f"{source}: a {cfg.train.method} run on the catalog model {spec.name!r}, whose frozen base "
                          f"was a random init that the checkpoint does not hold; export needs a model folder "
                          f"with weights as model.name")
