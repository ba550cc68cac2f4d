"""Where torch's JIT keeps built extensions (DeepSpeed's ops): read by the DeepSpeed rank before it builds
and by `shardconsole doctor`, which must not pay for importing the rank's modules (torch._dynamo,
transformers: seconds) to look at a folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def extension_dir(name: str) -> Path:
    """Where torch's JIT puts extension `name` (torch.utils.cpp_extension._get_build_directory's rule,
    without its mkdir): TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py<ver>_<cpu|cuXY>. The
    folder is keyed by Python and CUDA versions only: environments with another torch or DeepSpeed
    share it, and ninja rebuilds the op each time the build flags differ (switching environments)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root
        acc = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
               f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{py}_{acc}")
    return Path(root) / name
