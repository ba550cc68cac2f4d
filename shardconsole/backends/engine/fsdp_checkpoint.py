"""FSDP2's checkpoint format in one room: what a save holds (the model's state, or under LoRA the adapters;
the optimizer's for a full checkpoint; each rank's RNG and loss-scaler state), how it is written (DCP through
save_stream.StreamingWriter, one tensor copied at a time) and read back (DCP with a .metadata reader that
runs no code, any world size: DCP reshards). The engine (fsdp_engine.py) calls `save` and `load`; step
folders, manifests and checksums are checkpoint/checkpoints.py's, for both engines. DeepSpeed's format is
ds_checkpoint.py.
"""

from __future__ import annotations

import io
import pickle
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from shardconsole.backends.checkpoint import checkpoints, save_stream
from shardconsole.backends.checkpoint.checkpoints import SaveKind
from shardconsole.backends.engine import trainstate
from shardconsole.backends.model import adapters
from shardconsole.backends.rank import common


def save(r: common.Rank, model, optim, scaling, data: trainstate.Data, step: int, kind: SaveKind) -> None:
    """DCP's format, written by save_stream.StreamingWriter: one tensor copied at a time, never the
    rank's whole state (DCP's own writer holds a copy of every tensor until the file closes)."""
    if r.cfg.fsdp.cpu_offload and r.is_cuda:
        # torch keeps the pinned blocks the gradients came to the host in, cached for the next step's;
        # a save writes a tensor copy of its own beside them: give them back first (pinned again at the
        # next step, about a second), so the host peak is the larger of the two, not their sum
        torch.cuda.synchronize()
        getattr(torch._C, "_host_emptyCache", lambda: None)()
    state = {"model": model_state(r, model), "step": torch.tensor(step)}
    if kind is SaveKind.CHECKPOINT:
        state["optim"] = get_optimizer_state_dict(model, optim)

    def write(tmp) -> dict[str, str]:
        writer = save_stream.StreamingWriter(tmp)
        dcp.save(state, storage_writer=writer)
        checkpoints.write_rank_state(tmp, r.rank, {"rng": trainstate.rng_state(r.device),
                                                   "scaler": scaling.state()})
        return writer.checksums

    checkpoints.run_save(r, step, kind, state_bytes(r, state), write, {"samples_consumed": data.samples})


def load(r: common.Rank, model, optim, scaling, data: trainstate.Data, placed: Callable[[], None]) -> int:
    """The newest complete checkpoint (any world size: DCP reshards) into the model, the optimizer, the
    loss scaler, the RNG and the data position; 0 when there is none. `placed()` runs once the tensors
    are in (the engine puts the optimizer's states in its host arena and refreshes its compute copy)."""
    checkpoints.remove_partials(r)
    found = checkpoints.newest_complete(r)
    if found is None:
        r.event("info", f"no checkpoint in {r.checkpoint_dir()}: starting from step 0")
        return 0
    state = {"model": model_state(r, model), "optim": get_optimizer_state_dict(model, optim),
             "step": torch.tensor(0)}
    try:
        dcp.load(state, storage_reader=SafeReader(str(found.path)), planner=safe_load_planner())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:   # DCP's CheckpointException (a BaseException) wraps each rank's error
        raise checkpoints.CheckpointError(f"{found.path}: cannot be read as an FSDP2 checkpoint: "
                                          f"{first_cause(e)}") from e
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not r.cfg.adapters))
    set_optimizer_state_dict(model, optim, state["optim"])
    placed()
    step = int(state["step"])
    restore_rank_state(r, found, scaling)
    data.seek(int(found.meta.get("samples_consumed", step * data.samples_per_step)))
    r.event("info", f"resumed from {found.path} (step {step})")
    return step


def state_bytes(r: common.Rank, state: dict) -> int:
    """All ranks' bytes of the tensors to write (the local shards, summed over the ranks)."""
    own = sum(t.numel() * t.element_size() for t in _tensors(state))
    total = torch.tensor([own], dtype=torch.int64, device=r.device)
    torch.distributed.all_reduce(total)
    return int(total.item())


def _tensors(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, torch.Tensor):
        yield obj.to_local() if hasattr(obj, "to_local") else obj


def model_state(r: common.Rank, model) -> dict:
    """What a checkpoint holds of the model: every weight, or under LoRA only the adapters (the base is
    the model folder's, unchanged)."""
    state = get_model_state_dict(model)
    return adapters.trained_state(state, model) if r.cfg.adapters else state


def restore_rank_state(r: common.Rank, found: checkpoints.Found, scaling) -> None:
    own = checkpoints.read_rank_state(found.path, r.rank)
    if own is None or found.meta.get("world", r.world) != r.world:
        # Another rank count: the weights and moments reshard, the per-rank RNG streams do not.
        r.event("warning", f"{found.path} was written by {found.meta.get('world', '?')} rank(s), this run has "
                           f"{r.world}: weights and optimizer resharded, random states start afresh")
        own = checkpoints.read_rank_state(found.path, 0) if own is None else own
        if own:
            scaling.load(own.get("scaler"))
        return
    trainstate.set_rng_state(own["rng"], r.device)
    scaling.load(own.get("scaler"))


def first_cause(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) and inner else getattr(inner, "exc", inner)
        return f"{type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"[:400]
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]


# ---------------------------------------------------------------------------------------------------
# DCP's .metadata without running code from it

_SAFE_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_SAFE_NAMES = {("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("builtins", "set"),
               ("builtins", "frozenset"), ("builtins", "slice")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_NAMES:
            return super().find_class(module, name)
        if module.startswith(_SAFE_MODULE_PREFIXES):
            found = super().find_class(module, name)
            if isinstance(found, type):     # DCP's metadata dataclasses and enums, never a function
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint's .metadata "
                                     f"(only DCP's own metadata classes are allowed)")


class SafeReader(FileSystemReader):
    """DCP's reader with its .metadata (a pickle) read by an unpickler that builds only DCP's metadata
    classes, torch sizes and dtypes: a crafted .metadata cannot run code. The tensor files are read by
    DCP itself with torch.load(weights_only=True)."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            metadata = _Unpickler(io.BytesIO(fh.read())).load()
        from torch.distributed.checkpoint.metadata import StorageMeta
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_load_planner():
    """DCP's default load planner with its non-tensor items (optimizer hyper-parameters, the step)
    read by torch.load(weights_only=True) instead of weights_only=False."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            # A run resumed with precision.master_rounding = "kahan" from a checkpoint written without it
            # (stochastic or nearest): the compensation buffer starts at zero, as on a first step, instead
            # of failing the whole load on its missing keys. Every other missing key still fails.
            if metadata is not None and self.flatten_state_dict:
                saved = metadata.state_dict_metadata
                for key in [k for k in self.state_dict if k.endswith(".compensation") and k not in saved]:
                    del self.state_dict[key]

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()
