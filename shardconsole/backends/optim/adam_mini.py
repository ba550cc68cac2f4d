"""optim.name = "adam-mini": AdamW in 6 host bytes a parameter with fp32 masters, 4 with bf16 ones (issue 60).

What fp32-master AdamW keeps, 16 bytes a parameter (fp32 weight, gradient and two moments), is what
keeps an 8B full fine-tune off a 64 GB box. Here, byte by byte:

- **The weight, fp32 exactly, in 4 bytes that double as the compute copy.** The parameter FSDP2 shards
  is bf16, the fp32 master rounded to nearest (what the all-gather sends, so no separate compute copy),
  and the state `weight_low` (int16) holds the rest of the fp32 bits: fp32 bits = (bf16 bits << 16) +
  low, exactly. The update reads the fp32 master, does fp32 AdamW arithmetic and splits the result
  again: no bit of an fp32 master is lost, however small the update. With precision.master_dtype =
  "bf16" there is no remainder and the weight is rounded stochastically (master_update.py): 2 bytes.
- **The first moment in bf16, rounded stochastically** (2 bytes): unbiased, and m is an average of the
  last ~10 gradients (beta1 0.9), so the rounding noise does not build up (measured below).
- **The second moment a row** (Adam-mini, Zhang et al. 2024, "Use Fewer Learning Rates To Gain More"):
  one fp32 value per output neuron of a linear layer (a row of its [out, in] weight) and per token of
  the embedding and head (a row too): the mean of the row's squared gradients, averaged over steps as
  Adam averages each one's. Adam's per-value v is the byte-hungry half of its state and, for a
  transformer's weights, mostly the same within such a block (the paper's Hessian argument; its SFT
  and RLHF of Llama-2-7B match AdamW). 1-D parameters (norms, biases) keep a v per value. A few MB
  for an 8B model. Not 8-bit moments: a moment rounded to 8 bits either sticks (round to nearest:
  0.999 * v rounds back to v) or random-walks (stochastic: with v's 1/1000 pull back, per-step
  noise of a few percent wanders by tens of percent).

So 2 + 2 + 2 = 6 bytes a parameter with fp32 masters, 4 with bf16 masters and stochastic rounding,
plus the gradients, which never sit on the host for the whole model: with offload_overlap each unit's
gradients are stepped and freed as they land (offload/overlap.py).

The update (torch's AdamW formula, decoupled weight decay, bias corrections) runs on the host as a C++
op (adam_mini_cpu.py) or, on a GPU and where no compiler is, as the chunked torch code below; both
are the same arithmetic in the same order, and use the same rounding bits: a hash of the value's own
fp32 bits, the element's index and a per-step, per-tensor seed (train.seed and the rank). Tested
against fp32-master AdamW's held-out loss in tests/test_adam_mini.py.
"""

from __future__ import annotations

import torch

from shardconsole.backends.optim.master_update import mixed_seed

NAME = "adam-mini"
# Bytes a parameter of what the optimizer keeps (weight, its fp32 remainder, the first moment); the rows'
# second moment and the gradients in flight are counted apart (plan/optim_states.py).
BYTES_PER_PARAM = {"fp32": 6, "bf16": 4}

_MIX = -1640531535          # 0x9E3779B1, as master_update's hash
_INDEX_MIX = -2048144789    # 0x85EBCA6B (murmur3's), spreads the element index over the seed
_LOW16, _HIGH16 = 0xFFFF, -65536
_CHUNK_ROWS_VALUES = 1 << 22    # values a chunk of the torch update (bounds its temporaries)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def rows_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The second moment's shape for a parameter: one value a row (all dims but the last) for a matrix,
    one a value for a vector."""
    return tuple(shape[:-1]) if len(shape) >= 2 else tuple(shape)


def layout(local: torch.Tensor, split: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The state tensors of one (local) parameter: name -> (shape, dtype). `split`: a bf16 parameter that
    stands for an fp32 master (its low 16 bits kept in weight_low)."""
    out = {"exp_avg": (tuple(local.shape), local.dtype),
           "exp_avg_sq_row": (rows_shape(local.shape), torch.float32)}
    if split and local.dtype == torch.bfloat16:
        out["weight_low"] = (tuple(local.shape), torch.int16)
    return out


def as_state(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a state tensor of parameter `p`: a DTensor sharded as p is (dim 0 over the same mesh)
    when p is one, with its own global shape and dtype, and left where it is (a host tensor stays on the
    host: DTensor.from_local would move it to the mesh's device)."""
    if not hasattr(p, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    shape = tuple(p.shape) if local.dim() == p.dim() else rows_shape(p.shape)
    stride = tuple(torch.empty(shape, device="meta").stride())
    spec = DTensorSpec(p.device_mesh, tuple(p.placements), tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _noise(bits: torch.Tensor, seed: int, index: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_and(torch.bitwise_right_shift((bits ^ seed ^ (index * _INDEX_MIX)) * _MIX, 16), _LOW16)


def round_stochastic(x: torch.Tensor, seed: int, index: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, up with the probability of the distance to the lower neighbour (unbiased)."""
    bits = x.view(torch.int32)
    return torch.bitwise_and(bits + _noise(bits, seed, index), _HIGH16).view(torch.float32).to(torch.bfloat16)


def join(hi: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 master from its bf16 part and its int16 remainder (exact)."""
    return (torch.bitwise_left_shift(hi.view(torch.int16).to(torch.int32), 16) + low.to(torch.int32)).view(torch.float32)


def split_(w32: torch.Tensor, hi: torch.Tensor, low: torch.Tensor) -> None:
    """w32 into hi (bf16, to nearest) and low (the int16 remainder), so that join gives w32 back bit for bit."""
    bits = w32.view(torch.int32)
    top = torch.bitwise_right_shift(bits + 0x8000, 16)
    low.copy_((bits - torch.bitwise_left_shift(top, 16)).to(torch.int16))
    hi.view(torch.int16).copy_(top.to(torch.int16))


def update_torch(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, low: torch.Tensor | None,
                 hp: list[float], seed_w: int, seed_m: int) -> None:
    """One update of one local parameter, in place, in torch ops, a chunk of rows at a time.
    w, g, m: contiguous, shaped [rows, cols]; v: [rows] fp32; low: int16 like w (fp32 masters) or None.
    hp: hyper_parameters(...), fp32 values. The C++ op computes the same expressions in the same order."""
    _, _, b2, decay, eps, step_size, bc2, inv_scale, wt, omb2 = hp
    rows, cols = w.shape
    chunk = max(1, _CHUNK_ROWS_VALUES // max(cols, 1))
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        g32 = g[r0:r1].float() * inv_scale
        m0 = m[r0:r1].float()
        m32 = m0 + (g32 - m0) * wt
        vr = v[r0:r1] * b2 + (g32 * g32).sum(-1) / cols * omb2
        v[r0:r1] = vr
        denom = (vr.sqrt() / bc2 + eps).unsqueeze(-1)
        w32 = join(w[r0:r1], low[r0:r1]) if low is not None else w[r0:r1].float()
        w32 = w32 * decay - step_size * m32 / denom
        index = torch.arange(r0 * cols, r1 * cols, dtype=torch.int64, device=w.device).to(torch.int32).view(r1 - r0, cols)
        if w.dtype == torch.float32:
            w[r0:r1] = w32
            m[r0:r1] = m32
            continue
        if low is not None:
            split_(w32.contiguous(), w[r0:r1], low[r0:r1])
        else:
            w[r0:r1] = round_stochastic(w32.contiguous(), seed_w, index)
        m[r0:r1] = round_stochastic(m32.contiguous(), seed_m, index)


def hyper_parameters(lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, step: float,
                     inv_scale: float) -> list[float]:
    """[lr, beta1, beta2, 1 - lr * weight_decay, eps, lr / bias_correction1, sqrt(bias_correction2),
    1 / grad_scale, 1 - beta1, 1 - beta2], each rounded to fp32 once here, so that the torch code (fp32
    tensors times Python floats) and the C++ op (floats) compute with the same numbers."""
    exact = [lr, beta1, beta2, 1 - lr * weight_decay, eps, lr / (1 - beta1 ** step), (1 - beta2 ** step) ** 0.5,
             inv_scale, 1 - beta1, 1 - beta2]
    return torch.tensor(exact, dtype=torch.float32).tolist()


def joined_state(model: torch.nn.Module, optim: torch.optim.Optimizer, state: dict) -> dict:
    """`state` (the model's state dict) with each split parameter replaced by its fp32 master (the bf16
    weight joined with its weight_low), sharded as the parameter is: an fp32 export of every bit."""
    out = dict(state)
    for name, p in model.named_parameters():
        low = optim.state.get(p, {}).get("weight_low")
        if low is not None and name in out:
            out[name] = as_state(p, join(_local(p).detach().contiguous(), _local(low)))
    return out


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as [rows, cols]: a matrix's rows, a vector's values as rows of one."""
    return t.view(-1, t.shape[-1]) if t.dim() >= 2 else t.view(-1, 1)


class AdamMini(torch.optim.Optimizer):
    """AdamW with a per-row second moment, a bf16 first moment and (split) fp32 masters kept as bf16 +
    int16 (the module's docstring). Honours `grad_scale` as fused AdamW does (fsdp_step folds the clip
    into it), so `defaults["fused"]` is True. State per parameter: step, exp_avg, exp_avg_sq_row and,
    split, weight_low; DTensors sharded as the parameters are, so DCP checkpoints reshard them."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, split: bool = True, seed: int = 0, warn=None,
                 host_op: bool = True) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True))
        self.split, self.seed, self.warn = split, seed, warn
        self.grad_scale: torch.Tensor | None = None
        self.host_op, self.host_op_failed = host_op, None
        self.position = {id(p): i for i, p in enumerate((p for g in self.param_groups for p in g["params"]), 1)}

    def layout(self, local: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return layout(local, self.split)

    def state_tensor(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        return as_state(p, local)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load casts every floating state to its parameter's dtype: with bf16 weights that made the
        fp32 second moment bf16 (a resume of LoRA, or of unoffloaded parameters, failed its first step:
        "v is fp32"). Each state is taken back from the saved values in its own dtype (layout's)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            saved, state = state_dict["state"].get(i, {}), self.state.get(p, {})
            for name, (_, dtype) in self.layout(_local(p)).items():
                have = state.get(name)
                if have is not None and name in saved and _local(have).dtype != dtype:
                    state[name] = as_state(p, _local(saved[name]).to(device=_local(have).device, dtype=dtype))

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        local = _local(p)
        for name, (shape, dtype) in self.layout(local).items():
            if name not in state:
                # zeros: weight_low 0 is an fp32 master equal to the bf16 weight it starts from
                state[name] = as_state(p, torch.zeros(shape, dtype=dtype, device=local.device))
        return state

    def host_update(self):
        """The C++ host op's update function, or None (not built: the torch code runs, said once)."""
        if not self.host_op:
            return None
        from shardconsole.backends.optim import adam_mini_cpu
        mod, why = adam_mini_cpu.get()
        if mod is None and why and self.host_op_failed is None:
            self.host_op_failed = why
            if self.warn is not None:
                self.warn(f"optim.name = \"adam-mini\": the C++ host step could not be built ({why}); "
                          "running the torch update (slower)")
        return mod

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the clip folded into the step (fsdp_step.Clip): one read of its factor a step, not one a parameter
        scale = 1.0 if self.grad_scale is None else 1.0 / float(self.grad_scale)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p)
                state["step"] += 1
                step = float(state["step"])
                w = _local(p)
                if not w.numel():
                    continue
                lr, wd = float(group["lr"]), group["weight_decay"]
                hp = hyper_parameters(lr, beta1, beta2, wd, group["eps"], step, scale)
                index = self.position[id(p)]
                seeds = [mixed_seed(self.seed, int(step), index, k) for k in range(2)]
                low = state.get("weight_low")
                self._update(w, _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq_row"]),
                             None if low is None else _local(low), hp, seeds)
        return loss

    def _update(self, w, g, m, v, low, hp, seeds) -> None:
        tensors = [w, g, m, low]
        flat = [None if t is None else (t if t.is_contiguous() else t.contiguous()) for t in tensors]
        w2, g2, m2 = (_matrix(t) for t in flat[:3])
        low2 = None if flat[3] is None else _matrix(flat[3])
        v1 = v.reshape(-1)
        mod = self.host_update() if w.device.type == "cpu" else None
        if mod is not None:
            mod.update(w2, g2, m2, v1, low2 if low2 is not None else w2.new_empty(0, dtype=torch.int16),
                       torch.tensor(hp, dtype=torch.float32), seeds[0], seeds[1])
        else:
            update_torch(w2, g2, m2, v1, low2, hp, seeds[0], seeds[1])
        for t, f in zip(tensors, flat):
            if t is not None and f is not None and f.data_ptr() != t.data_ptr():    # updated in a copy
                t.copy_(f)
        if v1.data_ptr() != v.data_ptr():
            v.copy_(v1.view_as(v))
