"""The state of FSDP2's optimizer step beside the optimizer itself, in two small objects, so the loop in
fsdp.py reads like nanoGPT's: `scaling.backward(loss)`, `norm = clip(step, grads_changed)`,
`scaling.step(optim)`.

- `LossScaling`: fp16's ShardedGradScaler (None otherwise), its skipped-step count kept on the device
  (no sync), the minimum scale, and its state for checkpoints.
- `Clip`: the gradient clip, folded into fused AdamW when it can be (the norm summed where each
  reduce-scatter lands when offloaded), else torch's clip_grad_norm_.

DCP's restricted .metadata reader (`SafeReader`) is fsdp_checkpoint.py's, with the rest of the format.
"""

from __future__ import annotations

import torch

from shardconsole.backends.rank import common
from shardconsole.backends.offload import host_copy as offload
# export_model/checkpoint.py imports SafeReader from here
from shardconsole.backends.engine.fsdp_checkpoint import SafeReader  # noqa: F401


class LossScaling:
    def __init__(self, r: common.Rank) -> None:
        self.r = r
        self.scaler = None
        self.min_scale = None
        self.skipped = torch.zeros((), device=r.device, dtype=torch.int64)
        self.reported = 0
        p = r.cfg.precision
        if p.dtype != "fp16":
            return
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        if p.hysteresis is not None:
            r.event("warning", "precision.hysteresis is a DeepSpeed setting; FSDP's scaler cuts the scale on "
                    "the first overflow")
        static = p.fp16_value("loss_scale")
        self.scaler = ShardedGradScaler(
            device=r.device.type, init_scale=static or 2.0 ** p.fp16_value("initial_scale_power"),
            growth_interval=p.fp16_value("loss_scale_window") if not static else 10**9,
            growth_factor=1.0 if static else 2.0, backoff_factor=1.0 if static else 0.5)
        self.min_scale = p.fp16_value("min_loss_scale")

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optim) -> None:
        if self.scaler:
            self.scaler.unscale_(optim)

    def step(self, optim) -> None:
        if not self.scaler:
            optim.step()
            return
        before = self.scaler._scale.clone()
        self.scaler.step(optim)
        self.scaler.update()
        self.skipped += (self.scaler._scale < before).to(torch.int64)   # on the device: no sync
        if self.min_scale:
            self.scaler._scale.clamp_(min=float(self.min_scale))        # in place on the device: no sync

    def value(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler else None

    def skipped_since_last_line(self) -> int:
        """The total skipped (one sync, on log steps); an `overflow` event for the new ones."""
        n = int(self.skipped)
        if n > self.reported:
            self.r.event("overflow", f"{n - self.reported} step(s) skipped on fp16 overflow since the last line; "
                         f"loss scale now {self.value():g}")
            self.reported = n
        return n

    def state(self) -> dict | None:
        if not self.scaler:
            return None
        return {"scaler": {k: (float(v) if isinstance(v, (float, torch.Tensor)) else v)
                           for k, v in self.scaler.state_dict().items()},
                "skipped": int(self.skipped)}

    def load(self, state: dict | None) -> None:
        if not self.scaler or not state:
            return
        self.scaler.load_state_dict(state["scaler"])
        self.skipped.fill_(int(state["skipped"]))
        self.reported = int(state["skipped"])


class Clip:
    def __init__(self, r: common.Rank, model, optim, scaling: LossScaling, reduce_dtype) -> None:
        self.r, self.model, self.optim = r, model, optim
        self.max_norm = r.cfg.train.clip_grad_norm
        # Fused AdamW applies the clip factor as it reads each gradient (not with fp16's scaler: that
        # sets grad_scale itself).
        self.folded = scaling.scaler is None and bool(optim.defaults.get("fused"))
        self.device_norm = None
        self.fallback_told = False
        if self.folded and self.max_norm > 0 and r.cfg.fsdp.cpu_offload:
            if offload.DeviceGradNorm.applies(model, reduce_dtype):
                self.device_norm = offload.DeviceGradNorm(model, r.device)
                r.log("offload: the gradient norm is summed where each reduce-scatter lands, before the copy "
                      "to the host")

    def __call__(self, grads_changed: bool = False):
        """Clip (or arrange the clip inside the optimizer step); returns the gradient norm or None."""
        if self.max_norm <= 0:
            return None
        if not self.folded:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        known = self.device_norm.take() if self.device_norm is not None else None
        if grads_changed:
            known = None     # a test fault wrote an inf after the reduce-scatters: read the host's
        elif self.device_norm is not None and known is None and not self.fallback_told:
            self.r.event("warning", "the gradient norm was not seen at every reduce-scatter; reading the host "
                         "gradients instead (slower)")
            self.fallback_told = True
        return offload.fold_clip_into_step(self.model.parameters(), self.optim, self.max_norm, self.r.device, known)
