"""ds_config -> settings, the zero_optimization block: the stage and each ZeRO knob shardconsole has, the
offload blocks (and the pre-0.5 booleans old example configs still carry), and the keys it skips and why.
Its own module because the block is a small format of its own: the one part of a ds_config with nested
blocks, deprecated spellings and settings that shardconsole holds once for two DeepSpeed blocks."""

from __future__ import annotations

from typing import Any

from shardconsole.settings import config as C
from shardconsole.ds_json.export import DS_OFFLOAD_PIN_DEFAULT, DS_ZERO_DEFAULTS, ZERO_KEYS, ZERO_BOOL_KEYS
from shardconsole.ds_json.import_report import OFFLOAD_UNMAPPED, ZERO_UNMAPPED, ImportReport, known_hint

_ZERO_ALL = ["stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param",
             "cpu_offload_use_pin_memory", *ZERO_KEYS, *ZERO_UNMAPPED]


def read_zero(im: ImportReport, z: Any, base: C.RunConfig) -> None:
    """The file's zero_optimization block into im (None: no block, so DeepSpeed's defaults, stage 0)."""
    if z is None:
        z = {}
    if not isinstance(z, dict):
        raise im.error("zero_optimization", f"expected an object, got {z!r}")
    _zero_keys(im, z, base.deepspeed)
    _zero_offload(im, _offload_blocks(im, z))
    for key in z:
        if key in ZERO_UNMAPPED:
            im.skip(f"zero_optimization.{key}", ZERO_UNMAPPED[key])
        elif key not in _ZERO_ALL:
            im.skip(f"zero_optimization.{key}", known_hint(key, _ZERO_ALL))


def _zero_keys(im: ImportReport, z: dict, ds: Any) -> None:
    """The stage, then each ZeRO knob shardconsole has (the file's, or DeepSpeed's default)."""
    stage = z.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise im.error("zero_optimization.stage", f"expected 0, 1, 2 or 3, got {stage!r}")
    stage = int(stage)
    if "stage" in z:
        im.set("deepspeed", "stage", stage, "zero_optimization.stage")
    else:
        im.default("deepspeed", "stage", 0)
    for key in ZERO_KEYS:
        where = f"zero_optimization.{key}"
        if key in z:
            value = z[key]
            if im.auto(where, value, f"deepspeed.{key} = {getattr(ds, key)}"):
                continue
            value = im.boolean(where, value) if key in ZERO_BOOL_KEYS else im.number(where, value, integer=True)
            im.set("deepspeed", key, value, where)
        else:
            default = DS_ZERO_DEFAULTS[key]
            im.default("deepspeed", key, stage == 3 if key == "overlap_comm" else default)


def _offload_blocks(im: ImportReport, z: dict) -> dict[str, Any]:
    """Offload: the current blocks, and the pre-0.5 booleans that old example configs still carry."""
    blocks = {"offload_optimizer": z.get("offload_optimizer"), "offload_param": z.get("offload_param")}
    # (DeepSpeed turns them into blocks with default pinning and ignores cpu_offload_use_pin_memory.)
    if z.get("cpu_offload") is True and blocks["offload_optimizer"] is None:
        blocks["offload_optimizer"] = {"device": "cpu"}
        im.mapped.append("zero_optimization.cpu_offload = true (DeepSpeed's old name for offload_optimizer cpu)")
    if z.get("cpu_offload_param") is True and blocks["offload_param"] is None:
        blocks["offload_param"] = {"device": "cpu"}
        im.mapped.append("zero_optimization.cpu_offload_param = true (DeepSpeed's old name for offload_param cpu)")
    if "cpu_offload_use_pin_memory" in z:
        im.skip("zero_optimization.cpu_offload_use_pin_memory", "deprecated; DeepSpeed ignores it (pin_memory "
                "inside the offload blocks counts)")
    return blocks


def _zero_offload(im: ImportReport, blocks: dict[str, Any]) -> None:
    """Each offload block's device; the pinning and the NVMe folder, which shardconsole has once for both."""
    pins: list[tuple[str, bool]] = []
    paths: list[tuple[str, str]] = []
    for name, block in blocks.items():
        where = f"zero_optimization.{name}"
        if block is None:
            im.default("deepspeed", name, "none")
            continue
        if not isinstance(block, dict):
            raise im.error(where, f"expected an object, got {block!r}")
        dev = block.get("device", "none")
        if dev not in ("none", "cpu", "nvme"):
            raise im.error(f"{where}.device", f"expected \"none\", \"cpu\" or \"nvme\", got {dev!r}")
        im.set("deepspeed", name, dev, f"{where}.device")
        if dev == "none":
            continue
        pins.append((f"{where}.pin_memory", im.boolean(f"{where}.pin_memory",
                                                       block.get("pin_memory", DS_OFFLOAD_PIN_DEFAULT))))
        if dev == "nvme":
            p = block.get("nvme_path")
            if not isinstance(p, str) or not p:
                raise im.error(f"{where}.nvme_path", "device \"nvme\" needs nvme_path, a folder on a fast disk")
            paths.append((f"{where}.nvme_path", p))
        for key in block:
            if key in OFFLOAD_UNMAPPED:
                im.skip(f"{where}.{key}", "not a shardconsole setting; DeepSpeed's default applies")
            elif key not in ("device", "pin_memory", "nvme_path"):
                im.skip(f"{where}.{key}", "not a shardconsole setting")
    if pins:
        key, pin = pins[0]
        im.set("deepspeed", "pin_memory", pin, key)
        for other, value in pins[1:]:
            if value != pin:
                im.skip(other, f"{value}: shardconsole pins both offloads alike; {key} = {pin} wins")
    if paths:
        key, path = paths[0]
        im.set("deepspeed", "nvme_path", path, key)
        for other, other_path in paths[1:]:
            if other_path != path:
                im.skip(other, f"{other_path!r}: shardconsole uses one nvme_path; {key} wins")

