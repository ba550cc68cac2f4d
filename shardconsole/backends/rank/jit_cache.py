"""Where torch's JIT keeps built extensions (DeepSpeed's ops): read by the DeepSpeed rank before it builds
and by `shardconsole doctor`, which must not pay for importing the rank's modules (torch._dynamo,
transformers: seconds) to look at a folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from shardconsole.envvars import read


def extension_dir(name: str) -> Path:
    """Where torch's JIT puts extension `name` (torch.utils.cpp_extension._get_build_directory's rule,
    without its mkdir): TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py<ver>_<cpu|cuXY>. The
    folder is keyed by Python and CUDA versions only: environments with another torch or DeepSpeed
    share it, and ninja rebuilds the op each time the build flags differ (switching environments)."""
    root = read("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root
        acc = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
               f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{py}_{acc}")
    return Path(root) / name


def clear_stale_lock(name: str, started: float) -> str | None:
    """Remove the build lock of extension `name` that a killed process left behind; the reason, or None.

    torch's JIT guards a build with a bare lock file (FileBaton: created with O_EXCL, no pid, deleted
    when the build ends), and every later load of the op waits for it to go, forever. A rank killed
    while it built (Ctrl-C twice, kill -9, an OOM) leaves one, and from then on every DeepSpeed run
    with that op on this machine sits in "building ops". A lock is taken as stale only when it is older
    than this process (`started`, so a peer rank of this run building now is left alone) and no process
    works in the build folder (ninja and the compiler run there: another run building now is left
    alone too)."""
    lock = extension_dir(name) / "lock"
    try:
        created = lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if created >= started:
        return None
    import psutil
    folder = str(lock.parent)
    for p in psutil.process_iter():
        try:
            if p.cwd() == folder:
                return None
        except (psutil.Error, OSError):
            continue
    try:
        lock.unlink()
    except FileNotFoundError:   # a peer rank removed it first, and says so
        return None
    import time
    return (f"removed {lock}: a build lock left {time.time() - created:.0f} s ago by a process that is gone "
            f"(no build runs in its folder); with it every load of {name} waited forever")


# The host ops' build (optim/rounded_update_cpu.py, optim/adam_mini_cpu.py): vectorised for this CPU, fp32
# arithmetic in the written order (no fused multiply-add), split over torch's OpenMP threads.
HOST_OP_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
_host_ops: dict[str, tuple[object | None, str | None]] = {}


def load_host_op(name: str, source: str, functions: list[str]) -> tuple[object | None, str | None]:
    """(the built module, None) or (None, why it could not be built): torch's load_inline of a C++ CPU op,
    once a process per name (cached on disk by torch across processes)."""
    if name not in _host_ops:
        try:
            import psutil
            from torch.utils.cpp_extension import load_inline
            # a build killed midway leaves torch's lock file, and every later load would wait on it
            clear_stale_lock(name, psutil.Process().create_time())
            _host_ops[name] = (load_inline(name, cpp_sources=[source], functions=functions,
                                           extra_cflags=HOST_OP_FLAGS, extra_ldflags=["-fopenmp"], verbose=False), None)
        except Exception as e:   # noqa: BLE001 - no compiler, no headers, a failed build: the caller falls back
            _host_ops[name] = (None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}")
    return _host_ops[name]
