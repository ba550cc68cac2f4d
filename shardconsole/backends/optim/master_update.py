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

The arithmetic is torch's AdamW formula in fp32 over one chunk at a time, written as tensor expressions
that torch.compile fuses into one pass over memory (GPU machines); eager elsewhere. Compiled and eager
results can differ by one fp32 ulp, which picks other random bits: the same distribution, not the same
numbers (a run resumed on the same kind of machine repeats itself).

Measured (README, the 125m 500-step curve on an H200): final loss against fp32 masters +6.0% with
nearest, +0.87% stochastic, -0.07% kahan. Cost: on the host the update is compute-bound (three hashes
and roundings an element; Inductor's CPU code makes the fp32<->int32 bit views a scalar loop), 4.5x
torch's fused bf16 AdamW on the CI machine; 13B offloaded with stochastic rounding trains at 1,626
tokens/s on the H200 under a 24 GiB cap. The default stays nearest (config_tables.py says why).
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


def mixed_seed(*parts: int) -> int:
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


def _stochastic(x: torch.Tensor, seed: int) -> torch.Tensor:
    """round_stochastic_ as an expression (for the fused update): fp32 -> bf16."""
    bits = x.view(torch.int32)
    noise = torch.bitwise_and(torch.bitwise_right_shift(torch.bitwise_xor(bits, seed) * _MIX, 16), _LOW16)
    # Mask the low bits and cast the fp32 back (exact: they are zero). Not a shift to int16 viewed as
    # bf16: Inductor's CPU code for that is a scalar loop (one element an iteration), this one is vector
    # code, 1.8x faster on the CI machine's 2 cores.
    return torch.bitwise_and(bits + noise, _HIGH16).view(torch.float32).to(torch.bfloat16)


def update_chunk(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor | None,
                 hp: torch.Tensor, seed_w: int, seed_m: int, seed_v: int) -> None:
    """One AdamW update of bf16 tensors, in place, in fp32 arithmetic (torch's AdamW formula).
    hp: float32 [lr, beta1, beta2, 1 - lr * weight_decay, eps, lr / bias_correction1,
    sqrt(bias_correction2), 1 / grad_scale]; seeds: signed int32 values for the weight and the moments
    (Python ints: compiled with dynamic=True they are kernel arguments, not constants to recompile for).
    c: the Kahan compensation (the weight then rounds to nearest), or None (stochastic).
    Written as plain tensor expressions so torch.compile fuses it into one pass over memory."""
    lr, b1, b2, decay, eps, step_size, bc2_sqrt, inv_scale = hp.unbind()
    g32 = g.float() * inv_scale
    m32 = m.float().lerp(g32, 1 - b1)
    v32 = v.float() * b2 + g32 * g32 * (1 - b2)
    w32 = w.float() if c is None else w.float() + c.float()
    w32 = w32 * decay - step_size * m32 / (v32.sqrt() / bc2_sqrt + eps)
    if c is None:
        w.copy_(_stochastic(w32, seed_w))
    else:
        w_new = w32.to(torch.bfloat16)
        w.copy_(w_new)
        c.copy_((w32 - w_new.float()).to(torch.bfloat16))
    m.copy_(_stochastic(m32, seed_m))
    v.copy_(_stochastic(v32, seed_v))


_COMPILED: dict[str, object] = {}


def _fused(device_type: str):
    """update_chunk compiled for this device type (one C++/OpenMP loop on the host, one Triton kernel on
    the GPU), or the eager function when compiling is off or fails (then said once by the caller)."""
    if device_type not in _COMPILED:
        _COMPILED[device_type] = torch.compile(update_chunk, dynamic=True, fullgraph=True,
                                               options={"emulate_precision_casts": True})
    return _COMPILED[device_type]


class RoundedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's formula) over bf16 parameters, rounding the results into them
    as `rounding` says. Honours `grad_scale` as fused AdamW does (fsdp_step folds the clip into it), so
    `defaults["fused"]` is True for the caller's check. State per parameter: step, exp_avg, exp_avg_sq (bf16,
    like the parameter) and, for kahan, compensation (bf16); DTensors when the parameters are, so DCP
    checkpoints reshard them like torch's AdamW state."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, rounding: str = "stochastic", seed: int = 0,
                 chunk: int | None = None, compile: bool = False, warn=None, host_op: bool = True) -> None:
        if rounding not in ("stochastic", "kahan"):
            raise ValueError(f"rounding must be 'stochastic' or 'kahan' (nearest is torch's AdamW), not {rounding!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True))
        self.rounding, self.seed, self.chunk = rounding, seed, chunk
        self.grad_scale: torch.Tensor | None = None
        # compile: update_chunk fused by torch.compile (eager it makes ~25 passes over each chunk);
        # on a compile error the eager update is used on that device type, said once through `warn`.
        self.compile, self.warn = compile, warn
        self.compile_failed: dict[str, str] = {}
        # host_op: compiled on the host, the C++ op of rounded_update_cpu.py (False: Inductor's, to compare)
        self.host_op, self.host_op_failed = host_op, None     # and why that op could not be built
        self._hp: dict = {}
        # Each parameter's place in the whole optimizer, 1-based: its rounding seed's, also when a subset
        # of the parameters steps (offload_overlap steps one FSDP unit at a time).
        self.position = {id(p): i for i, p in enumerate((p for g in self.param_groups for p in g["params"]), 1)}

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
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index = self.position[id(p)]
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
        device = flat[0].device
        key = (device, step, lr, beta1, beta2, wd, eps)
        hp = self._hp.get(key)
        if hp is None:       # one small host-to-device copy a step, not one a parameter
            hp = torch.tensor([lr, beta1, beta2, 1 - lr * wd, eps, lr / (1 - beta1 ** step),
                               (1 - beta2 ** step) ** 0.5, 1.0], dtype=torch.float32, device=device)
            if scale is not None:
                hp[7:8].copy_(1.0 / scale.reshape(1))
            self._hp = {key: hp}
        fn = self._fn(device.type)
        chunk = self.chunk or ((1 << 24) if fn is not update_chunk else (1 << 22) if device.type == "cpu"
                               else (1 << 25))
        for j, start in enumerate(range(0, flat[0].numel(), chunk)):
            # detach(): the same storage, no view base. Dynamo guards a view on its base's shape, so a
            # chunk of a 2-D weight after one of a 1-D norm failed a guard and compiled again; on the
            # GPU machine (torch 2.11) that second kernel ran on one thread: 4.8 s a step at 1B.
            part = [t[start:start + chunk].detach() for t in flat]
            # the checkpointed step: a resumed run rounds alike
            args = (part[0], part[1], part[2], part[3], part[4] if len(part) == 5 else None, hp,
                    *(mixed_seed(self.seed, int(step), index, j, k) for k in range(3)))
            if fn is update_chunk:
                fn(*args)
                continue
            try:
                fn(*args)
            except Exception as e:   # noqa: BLE001 - compiling needs a C++ compiler / Triton: run eager
                self.compile_failed[device.type] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                if self.warn is not None:
                    self.warn(f"precision.master_rounding: the fused update did not compile on the "
                              f"{device.type} ({self.compile_failed[device.type]}); running it unfused (slower)")
                fn = update_chunk
                fn(*args)
        for t, f in zip(tensors, flat):
            if f.data_ptr() != t.data_ptr():          # a non-contiguous tensor was updated in a copy
                t.copy_(f.view_as(t))

    def _fn(self, device_type: str):
        if not self.compile or device_type in self.compile_failed:
            return update_chunk
        if device_type == "cpu" and self.host_op:       # the host step: the C++ op (rounded_update_cpu.py), else Inductor's
            from shardconsole.backends.optim import rounded_update_cpu
            built, why = rounded_update_cpu.get()
            if built is not None:
                return rounded_update_cpu.update_chunk
            if why and self.host_op_failed is None:
                self.host_op_failed = why
                if self.warn is not None:
                    self.warn(f"precision.master_rounding: the C++ host step could not be built ({why}); "
                              "running the compiled update (about 4x slower on the host)")
        return _fused(device_type)
