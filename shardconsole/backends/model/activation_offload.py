"""memory.activation_offload (issue 62): each checkpointed layer's saved input kept in pinned host memory
between its forward and its backward, instead of on the GPU.

With activation checkpointing a layer keeps only its input for backward (seq x hidden in the compute
dtype): at seq 32,768 an 8B's 32 layers keep 8 GiB of them, the GPU's largest part at long context.
Non-reentrant checkpointing saves those inputs as autograd saved tensors, so saved-tensor hooks around the
decoder's forward see them: `pack` copies each large one to a pinned host buffer on a side stream (the
forward goes on; the GPU tensor is freed once the copy is done) and `unpack`, when backward reaches that
layer, copies it back. What the recompute saves inside backward is not under the hooks and stays on the
GPU, as without offload. Parameters and small tensors (token ids, a layer's rotary cos/sin, seen once per
step) stay where they are: copying them each step would cost more than it saves. On a CPU rank the copy
is a plain clone, so the same path runs (and is tested) there.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

MIN_BYTES = 1 << 20        # smaller saved tensors stay: a copy's fixed cost outweighs what it frees


class Offloader:
    """The hooks of one rank; `active()` wraps a forward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copied_bytes = 0          # this step's bytes sent to the host (the planner's figure to check)

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.numel() * t.element_size() < MIN_BYTES:
            return t
        self.copied_bytes += t.numel() * t.element_size()
        if self.stream is None:
            return ("host", t.detach().clone(), None)
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        t.record_stream(self.stream)       # the GPU block is not reused before the copy has read it
        return ("host", host, done)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not (isinstance(packed, tuple) and len(packed) == 3 and packed[0] == "host"):
            return packed
        _, host, done = packed
        if done is None:
            return host
        done.synchronize()
        return host.to(self.device, non_blocking=True)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


def attach(r, model) -> None:
    """memory.activation_offload on the engine's CausalLMLoss (both engines call it once built)."""
    if r.cfg.memory.activation_offload:
        model.offload = Offloader(r.device)
        r.log("activation offload: each checkpointed layer's input kept in pinned host memory until its backward")
