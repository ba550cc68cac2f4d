"""DeepSpeed JSON in and out (shardconsole.ds_json), the FSDP -> ZeRO equivalents, and the DeepSpeed
combinations that settings validation refuses. No ranks here: these run in well under a minute."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from shardconsole.settings import config as C
from shardconsole import ds_json
from shardconsole.settings import resolve as S
from shardconsole.ds_json import ZERO_KEYS, from_ds_config, merge, to_ds_config
from tests.conftest import REPO, shardconsole

CONFIGS = REPO / "tests" / "data" / "ds_configs"
PRESETS = REPO / "presets"


def imported(d: dict, world: int = 1, base: C.RunConfig | None = None) -> tuple[C.RunConfig, list, list]:
    """What `shardconsole import` builds: the base preset with the file's settings on top."""
    base = base or C.build({"parallel": {"nproc_per_node": world}})
    over, mapped, unmapped = from_ds_config(json.loads(json.dumps(d)), "test.json", world_size=base.world_size,
                                            base=base)
    return C.build(merge(base.to_dict(), over), "test.json"), mapped, unmapped


# Every built-in preset made DeepSpeed, but those on torchao's low-bit AdamW: an FSDP2 optimizer that
# DeepSpeed cannot run (test_a_low_bit_preset_made_deepspeed_is_one_line).
FSDP_ONLY = sorted(p.stem for p in PRESETS.glob("*.toml")
                   if C.load_toml(p).get("optim", {}).get("name", "adamw") != "adamw")
DS_PRESETS = sorted(p.stem for p in PRESETS.glob("*.toml") if p.stem not in FSDP_ONLY)


def resolved(raw: dict, name: str, overrides: list[str]) -> tuple[C.RunConfig, list[str]]:
    """The settings pipeline over a preset document, as every front end resolves it."""
    r = S.resolve_doc(raw, name, name, S.from_cli(overrides))
    return r.cfg, r.notes


def owned(cfg: C.RunConfig) -> dict:
    """The settings the ds_config carries (pinning and the NVMe folder only matter with offload)."""
    t, p, d = cfg.train, cfg.precision, cfg.deepspeed
    out = {f"train.{k}": getattr(t, k) for k in
           ("micro_batch", "grad_accum", "lr", "beta1", "beta2", "weight_decay", "clip_grad_norm")}
    out.update({f"precision.{k}": getattr(p, k) for k in ("dtype", "reduce_dtype", "master_dtype", *p.FP16_KEYS)})
    out.update({f"deepspeed.{k}": getattr(d, k) for k in
                ("stage", "offload_optimizer", "offload_param", "torch_adam", *ZERO_KEYS)})
    if "none" != d.offload_optimizer or "none" != d.offload_param:
        out["deepspeed.pin_memory"] = d.pin_memory
    if "nvme" in (d.offload_optimizer, d.offload_param):
        out["deepspeed.nvme_path"] = d.nvme_path
    return out


# ---------------------------------------------------------------------------------------------------
# Export: the exact config, accepted by DeepSpeed's own config parser

def test_article_recipe_exports_as_the_article_wrote_it():
    cfg = C.load(PRESETS / "4090x2-zero3.toml")
    ds = to_ds_config(cfg)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == 1
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 6e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                                           "weight_decay": 0.01}}
    assert ds["fp16"] == {"enabled": True, "loss_scale_window": 100}
    assert "bf16" not in ds and "scheduler" not in ds
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in z
    assert z["overlap_comm"] and z["contiguous_gradients"] and z["reduce_scatter"] and z["allgather_partitions"]


def test_cpu_ranks_use_torch_adam_unless_the_optimizer_is_offloaded():
    cfg = C.build({"parallel": {"backend": "deepspeed", "device": "cpu"}})
    assert to_ds_config(cfg)["optimizer"]["params"]["torch_adam"] is True
    assert "torch_adam" not in to_ds_config(cfg, device="cuda")["optimizer"]["params"]
    cfg.deepspeed.offload_optimizer = "cpu"
    assert "torch_adam" not in to_ds_config(cfg)["optimizer"]["params"]   # DeepSpeed's CPUAdam
    cfg.deepspeed.torch_adam = True
    ds = to_ds_config(cfg)
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["zero_force_ds_cpu_optimizer"] is False


@pytest.mark.parametrize("preset", DS_PRESETS)
def test_every_preset_as_deepspeed_passes_deepspeeds_config_parser(preset):
    """DeepSpeed's own DeepSpeedConfig (pydantic, unknown keys forbidden) accepts each exported file.
    One rank, so that its batch arithmetic (no process group here: world size 1) holds."""
    from deepspeed.runtime.config import DeepSpeedConfig
    raw = C.load_toml(PRESETS / f"{preset}.toml")
    overrides = ["parallel.backend=deepspeed", "parallel.nproc_per_node=1", "train.compile=false"]
    cfg, _ = resolved(raw, preset, overrides)
    for device in ("cpu", "cuda"):
        ds = to_ds_config(cfg, device=device)
        parsed = DeepSpeedConfig(json.loads(json.dumps(ds)))
        assert parsed.zero_optimization_stage == cfg.deepspeed.stage
        assert parsed.train_batch_size == cfg.train.micro_batch * cfg.train.grad_accum
        assert parsed.gradient_clipping == cfg.train.clip_grad_norm
        assert parsed.float16_config.enabled == (cfg.precision.dtype == "fp16")
        assert parsed.bfloat16_config.enabled == (cfg.precision.dtype == "bf16")
        zc = parsed.zero_config
        assert zc.overlap_comm == cfg.deepspeed.overlap_comm
        assert zc.prefetch_bucket_size == cfg.deepspeed.stage3_prefetch_bucket_size
        assert zc.param_persistence_threshold == cfg.deepspeed.stage3_param_persistence_threshold
        assert (zc.offload_optimizer.device if zc.offload_optimizer else "none") == cfg.deepspeed.offload_optimizer


def test_export_cli_writes_only_json_to_stdout():
    res = shardconsole("export", "--preset", "4090x2-zero3", "--format", "deepspeed")
    assert res.returncode == 0, res.stderr
    ds = json.loads(res.stdout)                       # nothing but the JSON on stdout
    assert ds["zero_optimization"]["stage"] == 3 and ds["fp16"]["loss_scale_window"] == 100
    assert "scheduler" in res.stderr                  # notes go to stderr


def test_export_cli_to_a_file_refuses_to_overwrite(tmp_path):
    out = tmp_path / "ds.json"
    res = shardconsole("export", "--preset", "tiny-cpu", "--set", "parallel.backend=deepspeed",
                       "--set", "deepspeed.stage=2", "--format", "deepspeed", "-o", str(out))
    assert res.returncode == 0 and res.stdout == "", res.stderr
    ds = json.loads(out.read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["optimizer"]["params"]["torch_adam"] is True
    again = shardconsole("export", "--preset", "tiny-cpu", "--format", "deepspeed", "-o", str(out))
    assert again.returncode == 2 and "exists" in again.stderr and "--force" in again.stderr
    forced = shardconsole("export", "--preset", "tiny-cpu", "--format", "deepspeed", "-o", str(out), "--force")
    assert forced.returncode == 0 and json.loads(out.read_text())["zero_optimization"]["stage"] == 3


# ---------------------------------------------------------------------------------------------------
# --set parallel.backend=deepspeed: the closest ZeRO setup, only where the user did not choose

@pytest.mark.parametrize("sharding,stage", [("full_shard", 3), ("hybrid_shard", 3), ("shard_grad_op", 2),
                                            ("no_shard", 0)])
def test_fsdp_sharding_becomes_a_zero_stage(sharding, stage):
    raw = {"fsdp": {"sharding": sharding}, "parallel": {"nproc_per_node": 2}}
    cfg, notes = resolved(raw, "p", ["parallel.backend=deepspeed"])
    assert cfg.deepspeed.stage == stage
    assert (stage != 3 or sharding == "hybrid_shard") == bool(notes)


def test_fsdp_cpu_offload_becomes_param_and_optimizer_offload():
    raw = C.load_toml(PRESETS / "3090-offload.toml")
    cfg, notes = resolved(raw, "3090-offload", ["parallel.backend=deepspeed"])
    d = cfg.deepspeed
    assert (d.stage, d.offload_param, d.offload_optimizer, d.pin_memory) == (3, "cpu", "cpu", True)
    assert any("offload_param" in n for n in notes) and any("offload_optimizer" in n for n in notes)
    # shard_grad_op: ZeRO-2 cannot offload parameters, so only the optimizer moves.
    cfg, _ = resolved(raw, "p", ["parallel.backend=deepspeed", "fsdp.sharding=shard_grad_op"])
    assert (cfg.deepspeed.stage, cfg.deepspeed.offload_param, cfg.deepspeed.offload_optimizer) == (2, "none", "cpu")
    # no_shard: ZeRO stage 0 offloads nothing (and validation still passes).
    cfg, notes = resolved(raw, "p", ["parallel.backend=deepspeed", "fsdp.sharding=no_shard"])
    assert (cfg.deepspeed.stage, cfg.deepspeed.offload_optimizer) == (0, "none")
    assert any("stage 0 cannot offload" in n for n in notes)


def test_what_the_user_set_in_the_deepspeed_table_wins():
    raw = C.load_toml(PRESETS / "3090-offload.toml")
    # Set to the default value on purpose: still the user's choice, not a gap to fill.
    cfg, _ = resolved(raw, "p", ["parallel.backend=deepspeed", "deepspeed.offload_param=none",
                                                     "deepspeed.stage=3"])
    assert (cfg.deepspeed.offload_param, cfg.deepspeed.offload_optimizer) == ("none", "cpu")
    raw2 = merge(raw, {"deepspeed": {"stage": 1}})
    cfg, _ = resolved(raw2, "p", ["parallel.backend=deepspeed"])
    assert (cfg.deepspeed.stage, cfg.deepspeed.offload_param, cfg.deepspeed.offload_optimizer) == (1, "none", "cpu")


def test_deepspeed_presets_are_unchanged_and_fsdp_runs_untouched():
    raw = C.load_toml(PRESETS / "4090x2-zero3.toml")
    cfg, notes = resolved(raw, "4090x2-zero3", [])
    assert notes == [] and cfg == C.build(raw, "4090x2-zero3")
    cfg = C.load(PRESETS / "3090-offload.toml")
    assert S.apply_fsdp_equivalents(cfg, set()) == []


def test_export_of_an_fsdp_preset_is_its_deepspeed_equivalent():
    res = shardconsole("export", "--preset", "3090-offload", "--format", "deepspeed")
    assert res.returncode == 0, res.stderr
    z = json.loads(res.stdout)["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "cpu" and z["offload_optimizer"]["device"] == "cpu"
    assert "runs FSDP" in res.stderr and "offload_param" in res.stderr


# ---------------------------------------------------------------------------------------------------
# Import of real-world files

def test_import_article_zero3_json():
    cfg, mapped, unmapped = imported(json.loads((CONFIGS / "zero3.json").read_text()), world=2)
    t, p, d = cfg.train, cfg.precision, cfg.deepspeed
    # train_batch_size 32 = micro x accumulation 4 x 2 ranks
    assert (t.micro_batch, t.grad_accum, t.lr, t.weight_decay) == (4, 4, 6e-5, 0.01)
    assert (t.beta1, t.beta2, t.clip_grad_norm) == (0.9, 0.999, 0.0)    # what DeepSpeed runs when left out
    assert (p.dtype, p.loss_scale_window, p.initial_scale_power) == ("fp16", 100, None)
    assert (d.stage, d.offload_optimizer, d.offload_param, d.pin_memory) == (3, "cpu", "none", True)
    assert d.overlap_comm and d.contiguous_gradients and not d.torch_adam
    assert unmapped == []
    assert any(m.startswith("train_batch_size") and "micro_batch = 4" in m for m in mapped)
    # On one rank the same file means micro-batch 8.
    assert imported(json.loads((CONFIGS / "zero3.json").read_text()), world=1)[0].train.micro_batch == 8


def test_import_hugging_face_zero2_with_auto_values():
    base = C.build({"parallel": {"nproc_per_node": 2}, "train": {"micro_batch": 3, "lr": 1e-4}})
    cfg, mapped, unmapped = imported(json.loads((CONFIGS / "hf_ds_config_zero2.json").read_text()), base=base)
    d = cfg.deepspeed
    assert (d.stage, d.offload_optimizer, d.reduce_bucket_size, d.allgather_bucket_size) == (2, "cpu", 200_000_000,
                                                                                          200_000_000)
    assert (cfg.train.micro_batch, cfg.train.lr, cfg.precision.dtype) == (3, 1e-4, "bf16")   # "auto": kept
    why = dict(unmapped)
    assert "auto" in why["train_micro_batch_size_per_gpu"] and "auto" in why["optimizer.params.lr"]
    assert "auto" in why["fp16.enabled"] and "loss-scale" in why["fp16.loss_scale_window"]
    assert "log curve" in why["scheduler.params.warmup_type"]
    assert cfg.train.schedule == "constant"                         # WarmupLR: flat after warm-up


def test_import_hugging_face_zero3_full_offload():
    cfg, _, unmapped = imported(json.loads((CONFIGS / "hf_ds_config_zero3.json").read_text()))
    d = cfg.deepspeed
    assert (d.stage, d.offload_optimizer, d.offload_param, d.stage3_max_reuse_distance) == (3, "cpu", "cpu", 10**9)
    why = dict(unmapped)
    assert "sub_group_size" in " ".join(why) and "zero_to_fp32" in why[
        "zero_optimization.stage3_gather_fp16_weights_on_model_save"]
    assert "auto" in why["zero_optimization.stage3_prefetch_bucket_size"]


def test_import_deepspeed_example_with_legacy_cpu_offload():
    cfg, mapped, unmapped = imported(json.loads((CONFIGS / "megatron_zero2_cpu_offload.json").read_text()), world=2)
    d = cfg.deepspeed
    assert (d.stage, d.offload_optimizer, d.pin_memory, d.overlap_comm) == (2, "cpu", True, False)
    assert (cfg.train.micro_batch, cfg.train.grad_accum, cfg.train.lr) == (8, 1, 1.5e-4)   # "Adam" runs as AdamW
    assert (cfg.precision.dtype, cfg.precision.loss_scale, cfg.precision.hysteresis) == ("fp16", 0.0, 2)
    assert any("cpu_offload" in m for m in mapped)
    assert "memory.activation_checkpointing" in dict(unmapped)["activation_checkpointing"]


def test_import_deepspeed_example_zero_infinity_nvme():
    cfg, _, unmapped = imported(json.loads((CONFIGS / "megatron_zero_infinity.json").read_text()))
    d = cfg.deepspeed
    assert (d.stage, d.offload_optimizer, d.offload_param, d.nvme_path) == (3, "nvme", "nvme", "/nvme_data")
    assert (d.stage3_max_reuse_distance, d.reduce_bucket_size) == (10**8, 90_000_000)
    assert cfg.precision.loss_scale == 1024.0                       # static loss scale
    why = dict(unmapped)
    assert "stage3_param_persistence_threshold" in why["zero_optimization.stage3_param_persitance_threshold"]
    assert "optimizer" in why and "aio" in why


def test_import_cli_writes_a_preset_that_runs_the_same_config(tmp_path):
    out = tmp_path / "my-preset.toml"
    res = shardconsole("import", str(CONFIGS / "zero3.json"), "-o", str(out), "--nproc-per-node", "2")
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    assert "mapped" in res.stderr and "train.micro_batch = 4" in res.stderr and str(out) in res.stderr
    cfg = C.load(out)
    assert cfg.parallel.backend == "deepspeed" and cfg.parallel.nproc_per_node == 2
    ds = to_ds_config(cfg)
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 4
    # An existing file is kept unless --force.
    again = shardconsole("import", str(CONFIGS / "zero3.json"), "-o", str(out))
    assert again.returncode == 2 and "exists" in again.stderr and "--force" in again.stderr
    assert C.load(out).parallel.nproc_per_node == 2
    forced = shardconsole("import", str(CONFIGS / "zero3.json"), "-o", str(out), "--force",
                          "--set", "model.name=tiny", "--set", "parallel.device=cpu")
    assert forced.returncode == 0, forced.stderr
    assert C.load(out).train.micro_batch == 8 and C.load(out).parallel.device == "cpu"


@pytest.mark.parametrize("text,needle", [
    ('{"train_batch_size": 32,', "not valid JSON"),
    ('[1, 2]', "JSON object"),
    ('{"fp16": {"enabled": true}, "fp16": {"enabled": false}}', "appears twice"),
    ('{"train_batch_size": 30, "gradient_accumulation_steps": 4}', "train_batch_size"),
    ('{"fp16": {"enabled": true}, "bf16": {"enabled": true}}', "fp16.enabled"),
    ('{"zero_optimization": {"stage": 5}}', "zero_optimization.stage"),
    ('{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}', "nvme_path"),
    ('{"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}', "offload_param.device"),
    ('{"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}', "optimizer.params.lr"),
    ('{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}', "offload_param"),
    ('{"fp16": {"enabled": true, "hysteresis": 0}}', "hysteresis"),
])
def test_bad_ds_config_is_one_line_naming_the_file(tmp_path, text, needle):
    f = tmp_path / "bad.json"
    f.write_text(text)
    res = shardconsole("import", str(f), "-o", str(tmp_path / "x.toml"))
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("shardconsole: error: ") and str(f) in lines[-1] and needle in lines[-1], res.stderr
    assert not (tmp_path / "x.toml").exists()


def test_import_of_a_missing_file(tmp_path):
    res = shardconsole("import", str(tmp_path / "nope.json"))
    assert res.returncode == 2 and "no such file" in res.stderr and "nope.json" in res.stderr


# ---------------------------------------------------------------------------------------------------
# import(export(x)) == x for the settings the ds_config carries

_fp16_knob = {
    "initial_scale_power": st.none() | st.integers(0, 32),
    "loss_scale_window": st.none() | st.integers(1, 5000),
    "hysteresis": st.none() | st.integers(1, 8),
    "min_loss_scale": st.none() | st.sampled_from([0.0, 0.5, 1.0, 4.0]),
    "loss_scale": st.none() | st.sampled_from([0.0, 128.0, 1024.0]),
}


@st.composite
def deepspeed_settings(draw) -> dict:
    stage = draw(st.integers(0, 3))
    opt = draw(st.sampled_from(["none"] if stage == 0 else ["none", "cpu"] + (["nvme"] if stage == 3 else [])))
    param = draw(st.sampled_from(["none", "cpu", "nvme"] if stage == 3 else ["none"]))
    dtype = draw(st.sampled_from(["bf16", "fp16", "fp32"]))
    prec: dict = {"dtype": dtype}
    if draw(st.booleans()):
        prec["reduce_dtype"] = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    if dtype == "bf16" and stage >= 1 and draw(st.booleans()):
        prec["master_dtype"] = "bf16"
    if dtype == "fp16":
        for k, s in _fp16_knob.items():
            v = draw(s)
            if v is not None:
                prec[k] = v
    ds = {"stage": stage, "offload_optimizer": opt, "offload_param": param,
          "pin_memory": draw(st.booleans()), "torch_adam": draw(st.booleans()),
          "nvme_path": "/nvme/run" if "nvme" in (opt, param) else draw(st.sampled_from(["", "/x"]))}
    for k in ZERO_KEYS:
        ds[k] = draw(st.booleans()) if k in ds_json.ZERO_BOOL_KEYS else draw(st.integers(1, 2 * 10**9))
    small = st.floats(0, 1, allow_nan=False, exclude_max=True)
    return {
        "train": {"micro_batch": draw(st.integers(1, 16)), "grad_accum": draw(st.integers(1, 8)),
                  "lr": draw(st.floats(0, 1, allow_nan=False)), "beta1": draw(small), "beta2": draw(small),
                  "weight_decay": draw(st.floats(0, 1, allow_nan=False)),
                  "clip_grad_norm": draw(st.floats(0, 100, allow_nan=False))},
        "parallel": {"backend": "deepspeed", "nproc_per_node": draw(st.integers(1, 8))},
        "precision": prec,
        "deepspeed": ds,
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(deepspeed_settings())
def test_import_of_export_gives_back_the_settings(raw):
    x = C.build(raw, "generated")
    ds = json.loads(json.dumps(to_ds_config(x, device="cuda")))   # through a file's worth of JSON
    y, _, unmapped = imported(ds, world=x.world_size)
    assert unmapped == []                  # every key shardconsole writes, it reads back
    assert owned(y) == owned(x)
    assert to_ds_config(y, device="cuda") == to_ds_config(x, device="cuda")


@pytest.mark.parametrize("preset", DS_PRESETS)
def test_import_of_export_for_every_preset(preset):
    raw = C.load_toml(PRESETS / f"{preset}.toml")
    x, _ = resolved(raw, preset, ["parallel.backend=deepspeed"])
    y, _, unmapped = imported(to_ds_config(x, device="cuda"), world=x.world_size)
    assert unmapped == [] and owned(y) == owned(x)


# ---------------------------------------------------------------------------------------------------
# DeepSpeed combinations refused when the settings load, each naming its key

DS = {"parallel": {"backend": "deepspeed"}}


@pytest.mark.parametrize("extra,key", [
    ({"deepspeed": {"stage": 2, "offload_param": "cpu"}}, "[deepspeed] offload_param"),
    ({"deepspeed": {"stage": 1, "offload_param": "cpu"}}, "[deepspeed] offload_param"),
    ({"deepspeed": {"stage": 0, "offload_param": "nvme", "nvme_path": "/n"}}, "[deepspeed] offload_param"),
    ({"deepspeed": {"stage": 0, "offload_optimizer": "cpu"}}, "[deepspeed] offload_optimizer"),
    ({"deepspeed": {"stage": 3, "offload_optimizer": "nvme"}}, "[deepspeed] nvme_path"),
    ({"deepspeed": {"stage": 3, "offload_param": "nvme"}}, "[deepspeed] nvme_path"),
    ({"deepspeed": {"stage": 2, "offload_optimizer": "nvme", "nvme_path": "/n"}}, "[deepspeed] offload_optimizer"),
    ({"deepspeed": {"stage": 1, "offload_optimizer": "nvme", "nvme_path": "/n"}}, "[deepspeed] offload_optimizer"),
    ({"precision": {"dtype": "bf16", "loss_scale_window": 100}}, "[precision] loss_scale_window"),
    ({"precision": {"dtype": "bf16", "initial_scale_power": 12}}, "[precision] initial_scale_power"),
    ({"precision": {"dtype": "bf16", "hysteresis": 2}}, "[precision] hysteresis"),
    ({"precision": {"dtype": "fp32", "min_loss_scale": 1.0}}, "[precision] min_loss_scale"),
    ({"precision": {"dtype": "bf16", "loss_scale": 128.0}}, "[precision] loss_scale"),
    ({"parallel": {"backend": "deepspeed", "launcher": "deepspeed", "nnodes": 2, "rdzv_endpoint": "n0:29400"}},
     "[parallel] launcher"),
    ({"deepspeed": {"stage": 4}}, "[deepspeed] stage"),
    ({"deepspeed": {"offload_optimizer": "gpu"}}, "[deepspeed] offload_optimizer"),
])
def test_invalid_deepspeed_combination_names_the_key(extra, key):
    with pytest.raises(C.ConfigError) as e:
        C.build(merge(DS, extra), "p.toml")
    assert str(e.value).startswith(f"p.toml: {key}"), str(e.value)


def test_valid_deepspeed_combinations_load():
    for extra in ({"deepspeed": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                                 "nvme_path": "/n"}},
                  {"deepspeed": {"stage": 3, "offload_param": "nvme", "nvme_path": "/n"}},
                  {"deepspeed": {"stage": 1, "offload_optimizer": "cpu"}},
                  {"precision": {"dtype": "fp16", "hysteresis": 1, "min_loss_scale": 0.5}}):
        C.build(merge(DS, extra), "p.toml")


def test_bf16_masters_map_to_deepspeeds_bf16_master_weights_and_back():
    x = C.build(merge(DS, {"precision": {"dtype": "bf16", "master_dtype": "bf16"},
                           "deepspeed": {"stage": 3, "offload_optimizer": "cpu"}}), "p.toml")
    ds = to_ds_config(x, device="cuda")
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert "bf16_master_weights_and_grads" not in json.dumps(to_ds_config(C.build(DS, "p.toml"), device="cuda"))
    y, mapped, unmapped = imported(ds)
    assert y.precision.master_dtype == "bf16" and unmapped == []
    assert any("master_dtype" in line for line in mapped)
    # DeepSpeed refuses bf16 optimizer states without bf16 masters: reported, not imported
    _, _, unmapped = imported({"bf16": {"enabled": True, "bf16_optimizer_states": True}})
    assert "bf16.bf16_optimizer_states" in [k for k, _ in unmapped]


@pytest.mark.parametrize("extra", [{"precision": {"dtype": "fp16", "master_dtype": "bf16"}},
                                   {"precision": {"dtype": "bf16", "master_dtype": "bf16"}, "deepspeed": {"stage": 0}}])
def test_bf16_masters_need_bf16_compute_and_a_zero_stage(extra):
    with pytest.raises(C.ConfigError) as e:
        C.build(merge(DS, extra), "p.toml")
    assert str(e.value).startswith("p.toml: [precision] master_dtype"), str(e.value)


def test_invalid_combination_from_the_command_line_is_exit_2():
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--set", "parallel.backend=deepspeed",
                       "--set", "deepspeed.stage=2", "--set", "deepspeed.offload_param=cpu")
    # The cross-key check blames the override that set the key it names, not the preset file.
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        "shardconsole: error: --set deepspeed.offload_param: needs stage = 3 (stage is 2); parameters are "
        "partitioned only in stage 3"]


# ---------------------------------------------------------------------------------------------------
# Issue 20: an import trains as DeepSpeed would; the report counts what it lists; the exported file does
# not depend on the machine; --format hf-trainer

def test_import_without_a_scheduler_keeps_the_learning_rate_constant_as_deepspeed_does():
    from shardconsole.backends.rank.common import lr_factor
    base = C.build({"train": {"schedule": "cosine", "warmup_steps": 3, "steps": 40}})
    cfg, mapped, _ = imported(json.loads((CONFIGS / "zero3.json").read_text()), base=base)
    assert (cfg.train.schedule, cfg.train.warmup_steps) == ("constant", 0)
    # the multiplier shardconsole's loop applies: 1 at every step, as DeepSpeed with no scheduler
    assert {lr_factor(cfg, s) for s in range(1, cfg.train.steps + 1)} == {1.0}
    defaults: list[str] = []
    from_ds_config(json.loads((CONFIGS / "zero3.json").read_text()), "zero3.json", base=base, defaults=defaults)
    assert any(d.startswith("train.schedule = 'constant' (no scheduler block") for d in defaults)


def test_import_report_counts_exactly_the_lines_it_lists():
    res = shardconsole("import", str(CONFIGS / "zero3.json"))
    assert res.returncode == 0, res.stderr
    sections = {}
    for line in res.stderr.splitlines():
        if line.startswith("shardconsole import: "):
            head = line
            sections[head] = []
        elif line.startswith("  "):
            sections[head].append(line)
    assert len(sections) >= 2
    for head, lines in sections.items():
        m = re.search(r"mapped (\d+) setting\(s\):$|\((\d+)\):$", head)
        assert m and int(m.group(1) or m.group(2)) == len(lines), head
    mapped = next(v for k, v in sections.items() if "mapped" in k)
    assert len(mapped) == 11 and not any("default" in line for line in mapped)


def test_export_of_a_gpu_preset_is_the_same_file_on_a_machine_without_a_gpu():
    """This machine has no GPU: the file for parallel.device = "auto" is the GPU machine's (DeepSpeed
    picks FusedAdam / CPUAdam there), not the CPU ranks' torch_adam."""
    res = shardconsole("export", "--preset", "3090-fsdp", "--format", "deepspeed")
    assert res.returncode == 0, res.stderr
    ds = json.loads(res.stdout)
    assert "torch_adam" not in ds["optimizer"]["params"] and "zero_force_ds_cpu_optimizer" not in ds
    assert ds["scheduler"]["type"] == "WarmupCosineLR"
    cfg = S.resolve("3090-fsdp", S.from_cli(["parallel.backend=deepspeed"])).cfg
    assert ds["scheduler"]["params"] == {"total_num_steps": cfg.train.steps, "warmup_min_ratio": 0,
                                         "warmup_num_steps": max(1, cfg.train.warmup_steps),
                                         "cos_min_ratio": cfg.train.min_lr_ratio, "warmup_type": "linear"}
    # DeepSpeed's own parser takes the file, and importing it back gives the same schedule.
    from deepspeed.runtime.config import DeepSpeedConfig
    DeepSpeedConfig(json.loads(json.dumps(ds)))
    back, _, _ = imported(ds, world=cfg.world_size)
    assert (back.train.schedule, back.train.steps, back.train.min_lr_ratio) == ("cosine", cfg.train.steps,
                                                                                cfg.train.min_lr_ratio)


def test_export_hf_trainer_has_auto_placeholders_and_the_arguments_that_fill_them(tmp_path):
    out = tmp_path / "ds_hf.json"
    res = shardconsole("export", "--preset", "4090x2-zero3", "--format", "hf-trainer", "-o", str(out))
    assert res.returncode == 0, res.stderr
    ds = json.loads(out.read_text())
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        assert ds[key] == "auto"
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}
    assert ds["fp16"] == {"enabled": "auto", "loss_scale_window": 100} and "scheduler" not in ds
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    # The TrainingArguments line parses with transformers' own parser into the preset's values.
    import shlex
    from transformers import HfArgumentParser, TrainingArguments
    line = next(ln.strip() for ln in res.stderr.splitlines() if ln.strip().startswith("--deepspeed"))
    argv = shlex.split(line)
    assert argv[1] == str(out)
    i = argv.index("--deepspeed")
    argv = argv[:i] + argv[i + 2:] + ["--output_dir", str(tmp_path / "hf")]
    # (argparse's pass of transformers' own parser: TrainingArguments itself wants accelerate installed)
    args, unknown = HfArgumentParser(TrainingArguments).parse_known_args(argv)
    assert unknown == []
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 1)
    assert (args.learning_rate, args.adam_beta2, args.weight_decay, args.max_grad_norm) == (6e-5, 0.95, 0.01, 1.0)
    assert (args.max_steps, args.warmup_steps, args.fp16) == (50, 5, True)
    kwargs = args.lr_scheduler_kwargs
    assert str(args.lr_scheduler_type).endswith("cosine_with_min_lr")
    assert (json.loads(kwargs) if isinstance(kwargs, str) else kwargs) == {"min_lr_rate": 0.1}


def test_import_takes_the_rank_count_a_files_batch_keys_name():
    """An exported 2-rank file (16 = 8 x 1 x 2) imports as 2 ranks without --nproc-per-node; with it
    given, a mismatch is still refused."""
    ds = to_ds_config(C.load(PRESETS / "4090x2-zero3.toml"), device="cuda")
    over, mapped, _ = from_ds_config(ds, "ds.json", world_size=1, infer_ranks=True)
    assert over["parallel"]["nproc_per_node"] == 2 and over["train"]["micro_batch"] == 8
    assert mapped[0].startswith("train_batch_size / (micro x accumulation) -> parallel.nproc_per_node = 2")
    with pytest.raises(C.ConfigError, match="train_batch_size: 16 but"):
        from_ds_config(ds, "ds.json", world_size=1)


@pytest.mark.parametrize("preset", FSDP_ONLY)
def test_a_low_bit_preset_made_deepspeed_is_one_line(preset):
    raw = C.load_toml(PRESETS / f"{preset}.toml")
    with pytest.raises(C.ConfigError) as e:
        resolved(raw, preset, ["parallel.backend=deepspeed"])
    assert "[optim] name" in str(e.value) and "for the FSDP2 backend" in str(e.value)
    assert len(str(e.value).splitlines()) == 1
