"""The oldest torch shardconsole runs on, checked at start-up from the installed package's metadata
(importing torch would cost the console its fast start).

Why 2.8: the FSDP2 offload path (backends/offload/host_copy.py) reaches into FSDP2's internals, which moved and
grew over the releases:
- `torch.distributed.fsdp.fully_shard` and `torch.distributed.fsdp._fully_shard._fsdp_param` (FSDPParam,
  ShardedState): torch 2.6 (before, FSDP2 lived in torch.distributed._composable.fsdp);
- `FSDPModule.set_all_reduce_hook`, the hook that sums each unit's gradient on the GPU: torch 2.7
  (pytorch/pytorch#147114, February 2025);
- `torch.cuda._pin_memory_utils`, the in-place page-locking of the offload's host copies: used by DCP's
  state-dict stager (pytorch/pytorch#155192, June 2025), in torch 2.8.
The tests run on 2.13 (CPU) and the GPU figures on 2.11; nothing older than 2.8 has been run.
"""

from __future__ import annotations

import re
from importlib import metadata

MIN_TORCH = (2, 8)


def installed(package: str) -> str | None:
    """The installed version of `package`, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """(2, 7, 1) from "2.7.1+cu126" or "2.8.0a0+git1234"; () when it does not start with numbers."""
    m = re.match(r"^\s*(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def torch_problem() -> str | None:
    """One line saying why the installed torch cannot run shardconsole, or None when it can."""
    version = installed("torch")
    wanted = ".".join(map(str, MIN_TORCH))
    if version is None:
        import importlib.util
        if importlib.util.find_spec("torch") is not None:
            return None    # importable without package metadata (a source build on the path): the ranks tell
        return f"torch is not installed; shardconsole needs torch >= {wanted} (pip install torch)"
    found = release(version)
    if found and found[:2] < MIN_TORCH:
        return (f"torch {version} is installed; shardconsole needs torch >= {wanted} (its FSDP2 offload path "
                f"uses FSDP2 internals of that release): pip install 'torch>={wanted}'")
    return None


def version_line(own: str) -> str:
    """`shardconsole --version`: this package and the versions that decide how a run behaves."""
    parts = [f"{name} {installed(name) or 'not installed'}"
             for name in ("torch", "deepspeed", "transformers", "textual")]
    return f"shardconsole {own} ({', '.join(parts)})"
