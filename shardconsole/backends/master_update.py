"""AdamW for bf16 master weights that keeps the updates bf16 cannot hold (precision.master_rounding).

A bf16 weight has 8 significant bits: an update smaller than half a step of it (about 0.4% of the weight)
rounds back to the old value, every time. Late in training most updates are that small, so with
master_dtype = "bf16" and round-to-nearest the weights stop moving (the README's 125m curve: 5.66 against
5.31 with fp32 masters). The same happens to Adam's second moment: 0.999 * v rounds back to v, so v never
decays. Two remedies, both in the update itself (host step when offloaded, GPU step otherwise):

- "stochastic": each fp32 result is rounded up or down with the probability of its distance to the two
  bf16 neighbours (add 16 random low bits, truncate). Unbiased: the expected weight is the fp32 one, and
  no byte is added (8 bytes a parameter: bf16 weight, gradient and two moments).
- "kahan": the weight rounds to nearest and a bf16 buffer keeps what the rounding dropped, added back
  before the next update (10 bytes a parameter). Moments are rounded stochastically as above.
- "nearest": torch's fused AdamW, unchanged (see fsdp.make_optimizer).

The random bits are a hash of the value's own fp32 bits and a per-step, per-tensor, per-chunk seed from
train.seed and the rank: deterministic for a seed, independent of the thread count, the same code on the
CPU and the GPU, and cheaper than torch's CPU generator (which runs on one core).

The arithmetic is torch's own fused AdamW on fp32 copies of one chunk at a time (a few MiB, so the
copies stay in cache on the host): the update is exactly AdamW's; only where it lands differs.
"""

from __future__ import annotations

import torch

ROUNDINGS = ("stochastic", "kahan", "nearest")
# Bytes a parameter of the kept state on the host or GPU: weight + gradient + two Adam moments, plus the
# compensation buffer for kahan. fp32 masters: 16.
BYTES_PER_PARAM = {"nearest": 8, "stochastic": 8, "kahan": 10}

_MIX = -1640531535          # 0x9E3779B1 (Knuth's multiplicative hash) as a signed int32
_LOW16 = 0xFFFF
_HIGH16 = -65536            # 0xFFFF0000 as a signed int32


def _seed(*parts: int) -> int:
    """A signed int32 from a few integers (splitmix-style mixing in Python ints)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = (h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    h &= 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def round_stochastic_(x: torch.Tensor, out: torch.Tensor, seed: int) -> None:
    """Round fp32 `x` into bf16 `out` stochastically: up with probability (x - down) / (up - down).
    Overwrites `x` (a scratch copy). Adding a uniform 16-bit number to the bits and clearing the low 16
    rounds the magnitude up exactly when the dropped part plus the noise carries: sign-magnitude makes this
    symmetric for negative values."""
    bits = x.view(torch.int32)
    noise = torch.bitwise_xor(bits, seed)
    noise.mul_(_MIX).bitwise_right_shift_(16).bitwise_and_(_LOW16)
    bits.add_(noise).bitwise_and_(_HIGH16)
    out.copy_(x)        # exact: the low 16 bits are zero


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class RoundedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's formula) over bf16 parameters, rounding the results into them
    as `rounding` says. Honours `grad_scale` as fused AdamW does (fsdp_step folds the clip into it), so
    `defaults["fused"]` is True for the caller's check. State per parameter: step, exp_avg, exp_avg_sq (bf16,
    like the parameter) and, for kahan, compensation (bf16); DTensors when the parameters are, so DCP
    checkpoints reshard them like torch's AdamW state."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, rounding: str = "stochastic", seed: int = 0,
                 chunk: int | None = None) -> None:
        if rounding not in ("stochastic", "kahan"):
            raise ValueError(f"rounding must be 'stochastic' or 'kahan' (nearest is torch's AdamW), not {rounding!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True))
        self.rounding, self.seed, self.chunk = rounding, seed, chunk
        self.grad_scale: torch.Tensor | None = None

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.rounding == "kahan":
                state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scales: dict[torch.device, torch.Tensor] = {}
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self._init_state(p)
                state["step"] += 1
                w = _local(p)
                if self.grad_scale is not None and w.device not in scales:
                    scales[w.device] = self.grad_scale.to(w.device, torch.float32)
                tensors = [w, _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"])]
                if "compensation" in state:
                    tensors.append(_local(state["compensation"]))
                self._update(tensors, float(state["step"]), group["lr"], beta1, beta2, group["weight_decay"],
                             group["eps"], scales.get(w.device), index)
        return loss

    def _update(self, tensors: list[torch.Tensor], step: float, lr: float, beta1: float, beta2: float,
                wd: float, eps: float, scale: torch.Tensor | None, index: int) -> None:
        if not tensors[0].numel():
            return
        flat = [t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1) for t in tensors]
        chunk = self.chunk or ((1 << 22) if flat[0].device.type == "cpu" else (1 << 25))
        step_t = torch.empty((), dtype=torch.float32, device=flat[0].device)
        for j, start in enumerate(range(0, flat[0].numel(), chunk)):
            part = [t[start:start + chunk] for t in flat]
            w, g, m, v = (t.float() for t in part[:4])
            if len(part) == 5:
                w.add_(part[4])                       # what the last rounding dropped
            step_t.fill_(step)                        # the kernel reads it as is (torch counts it up before)
            torch._fused_adamw_([w], [g], [m], [v], [], [step_t], lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=False, grad_scale=scale,
                                found_inf=None)
            base = (self.seed, int(step), index, j)  # the checkpointed step: a resumed run rounds alike
            if len(part) == 5:
                part[0].copy_(w)                      # nearest
                part[4].copy_(w.sub_(part[0]))        # the remainder, exact in fp32, rounded into bf16
            else:
                round_stochastic_(w, part[0], _seed(*base, 0))
            round_stochastic_(m, part[2], _seed(*base, 1))
            round_stochastic_(v, part[3], _seed(*base, 2))
        for t, f in zip(tensors, flat):
            if f.data_ptr() != t.data_ptr():          # a non-contiguous tensor was updated in a copy
                t.copy_(f.view_as(t))
