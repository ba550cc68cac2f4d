"""Where an offloaded step goes, in one line: the verdict and the setting most likely to help.

Standard library only: the ranks call it with their measured phase times (backends/observe/step_timing.py),
tests call it with numbers of their own. The rule, from what overlaps with what in an offloaded step:
- the host optimizer step runs while the GPU waits (nothing overlaps it in a plain loop): when it is
  the largest part, the step is "host step bound";
- the copies run on their own streams beside the compute, and the GPU time measured is the compute
  stream's span (waits for copies included): when the busier copy direction fills most of that span
  (PCIE_SHARE), the compute was waiting on PCIe: "PCIe bound";
- otherwise the GPU's own compute is the step: "GPU bound" ("compute bound" on CPU ranks), and offload
  settings will not speed it up.
"""

from __future__ import annotations

from dataclasses import dataclass

HOST = "host step bound"
PCIE = "PCIe bound"
GPU = "GPU bound"
COMPUTE = "compute bound"
PCIE_SHARE = 0.8


@dataclass(frozen=True)
class Knobs:
    """The settings a hint can name, as this run has them."""
    backend: str = "fsdp"                  # "fsdp" / "deepspeed"
    compute_copy: bool = False             # fsdp.offload_compute_copy in force
    low_precision: bool = True             # precision.dtype is bf16/fp16
    pin_memory: bool = True
    offload_param: bool = True             # parameters on the host too (FSDP2 offload always; ZeRO-3 offload_param)
    checkpointing: bool = False
    compiled: bool = False
    # fsdp.offload_overlap is on but train.clip_grad_norm keeps the host step after the backward
    clip_blocks_overlap: bool = False


def verdict(gpu_s: float | None, host_step_s: float | None, h2d_s: float | None, d2h_s: float | None,
            knobs: Knobs, on_gpu: bool = True) -> tuple[str, str]:
    """(verdict, hint); ("", "") when there is nothing to judge yet."""
    gpu, host = gpu_s or 0.0, host_step_s or 0.0
    busier = max(h2d_s or 0.0, d2h_s or 0.0)
    if gpu <= 0 and host <= 0:
        return "", ""
    if host >= gpu:
        if knobs.clip_blocks_overlap:
            return HOST, ("train.clip_grad_norm = 0: without a clip fsdp.offload_overlap runs each layer's host "
                          "step under the backward (the clip needs every gradient's norm first)")
        return HOST, ("raise train.grad_accum: the host step is paid once per optimizer step, so more "
                      "micro-batches a step spread it over more tokens")
    if on_gpu and busier >= PCIE_SHARE * gpu:
        return PCIE, _pcie_hint(knobs)
    if not on_gpu:
        return COMPUTE, ""     # CPU ranks: no copies, no GPU; offload settings matter on a GPU run
    return GPU, _gpu_hint(knobs)


def _pcie_hint(k: Knobs) -> str:
    if not k.pin_memory:
        key = "fsdp.pin_memory" if k.backend == "fsdp" else "deepspeed.pin_memory"
        return f"{key} = true: copies from pageable memory run at a fraction of PCIe's rate"
    if k.backend == "fsdp" and k.low_precision and not k.compute_copy:
        return "fsdp.offload_compute_copy = true: the GPU is sent 2 bytes a parameter instead of 4"
    if k.backend == "deepspeed" and k.offload_param:
        return 'deepspeed.offload_param = "none": keep the parameters on the GPU, only the optimizer on the host'
    return "raise train.micro_batch: more compute for each byte copied (the copies are per step, not per token)"


def _gpu_hint(k: Knobs) -> str:
    if k.checkpointing:
        return ("memory.activation_checkpointing = false if `shardconsole plan` says it fits: the recompute "
                "is GPU time; offload is not what limits this step")
    if not k.compiled:
        return "train.compile = true: offload is not what limits this step, the GPU's compute is"
    return "offload is not what limits this step: the GPU's compute is"


def pcie_rates(h2d_bytes: int, d2h_bytes: int, step_s: float, rx_bps: float | None = None,
               tx_bps: float | None = None) -> tuple[float, float, str] | None:
    """Host<->GPU GB/s a step: the rank's own copied bytes over the step time where it counted them
    ("step average"); else NVML's reading of the card. NVML's counter is a 20 ms window sampled about
    once a second: offload copies come in bursts, and on the H200 it read 0.0 while the rank moved
    7 GB a 0.6 s step."""
    if (h2d_bytes or d2h_bytes) and step_s > 0:
        return h2d_bytes / step_s / 1e9, d2h_bytes / step_s / 1e9, "step average"
    if rx_bps is not None or tx_bps is not None:
        return (rx_bps or 0) / 1e9, (tx_bps or 0) / 1e9, "NVML"
    return None


def pcie_of(o, g) -> tuple[float, float, str] | None:
    """pcie_rates of an offload line `o` (protocol.OffloadTiming) on its card's GPU sample `g` (or None)."""
    return pcie_rates(o.h2d_bytes, o.d2h_bytes, o.step_s, g.pcie_rx_bps if g else None,
                      g.pcie_tx_bps if g else None)


def pcie_text(pcie: tuple[float, float, str]) -> str:
    return f"PCIe ↓{pcie[0]:.1f} ↑{pcie[1]:.1f} GB/s ({pcie[2]})"


def overlap_text(overlap: str, gpu_s: float | None, host_step_s: float | None, h2d_s: float | None,
                 d2h_s: float | None, step_s: float, host_hidden_s: float | None) -> str:
    """fsdp.offload_overlap's part of the view: how much of the host step ran under the backward, and how
    much of all the parts the step did not pay for (the copies run beside the compute on their own streams:
    what they hid is in that total). "" where the setting does not apply."""
    if not overlap:
        return ""
    if host_hidden_s is None or not host_step_s:
        return f"overlap {overlap}"
    parts = sum(x or 0.0 for x in (gpu_s, host_step_s, h2d_s, d2h_s))
    return (f"overlap {overlap}: host step {host_hidden_s:.3g} of {host_step_s:.3g} s hidden "
            f"({host_hidden_s / host_step_s:.0%}), parts {parts:.3g} s in a {step_s:.3g} s step "
            f"({max(0.0, parts - step_s) / parts:.0%} hidden)")


def line(v: str, hint: str, gpu_s: float | None, host_step_s: float | None, h2d_s: float | None,
         d2h_s: float | None, step_s: float, pcie: tuple[float, float, str] | None = None,
         pinned_bytes: int | None = None) -> str:
    """'offload: host step bound · GPU 0.41 s, host step 0.73 s, H2D 0.12 s, D2H 0.09 s of 1.31 s · PCIe
    ↓5.8 ↑6.3 GB/s (step average) · pinned 6.2 GiB · try: ...' (the headless line; the console shows the
    same parts). pcie: pcie_rates()."""
    def s(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3g} s"
    parts = [f"offload: {v or 'measuring'}",
             f"GPU {s(gpu_s)}, host step {s(host_step_s)}, H2D {s(h2d_s)}, D2H {s(d2h_s)} of {step_s:.3g} s a step"]
    if pcie is not None:
        parts.append(pcie_text(pcie))
    if pinned_bytes:
        parts.append(f"pinned {pinned_bytes / 2**30:.1f} GiB")
    out = " · ".join(parts)
    return out + (f" · try {hint}" if hint else "")
