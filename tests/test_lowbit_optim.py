"""optim.name = "adamw8bit" / "adamw4bit" (issue 35): torchao's low-bit AdamW in a real 2-rank FSDP2 run
on CPU, the planner's bytes for its states against the tensors torchao allocates, and the refusals."""

from __future__ import annotations

import pytest
import torch

from shardconsole.plan import estimator, optim_states
from shardconsole.plan.shapes import Shapes
from shardconsole.settings import config as C
from shardconsole.settings import models
from shardconsole.settings import resolve as settings
from tests.conftest import messages, of_kind, shardconsole

torchao_optim = pytest.importorskip("torchao.optim")


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_planner_moment_bytes_are_the_tensors_torchao_allocates(name):
    """For a quantized shard (>= 4096 values, a multiple of the block) and one left in fp32."""
    from shardconsole.backends.optim import lowbit_optim
    assert lowbit_optim.BLOCK_SIZE[name] == optim_states.BLOCK_SIZE[name]
    cfg = C.RunConfig()
    cfg.optim.name = name
    for numel in (8192, 2048):
        p = torch.nn.Parameter(torch.zeros(numel))
        opt = lowbit_optim.make(cfg, [p])
        buf = opt._new_buffer(p, signed=True)          # what its first step keeps for each moment
        inner = [getattr(buf, a) for a in buf.__tensor_flatten__()[0]] if hasattr(buf, "codes") else [buf]
        held = sum(t.numel() * t.element_size() for t in inner)     # codes, block scales, code book
        assert held == optim_states.moment_bytes(name, numel, 4), (name, numel)


def test_planner_counts_about_a_quarter_of_adams_bytes_for_8bit():
    cfg = settings.resolve("3090-fsdp", ["model.name=3b"]).cfg
    spec = models.resolve("3b")
    states = {}
    for name in ("adamw", "adamw8bit", "adamw4bit"):
        cfg.optim.name = name
        states[name] = estimator.model_states(cfg, spec)["gpu"]["optimizer states"]
    assert 0.24 < states["adamw8bit"] / states["adamw"] < 0.27
    assert 0.12 < states["adamw4bit"] / states["adamw"] < 0.14


@pytest.mark.parametrize("sets, says", [
    (["parallel.backend=deepspeed", "optim.name=adamw8bit"], "for the FSDP2 backend"),
    (["fsdp.cpu_offload=true", "optim.name=adamw4bit"], "without offload"),
])
def test_what_cannot_take_a_low_bit_optimizer_is_refused_in_one_line(tmp_path, sets, says):
    args = ["--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    res = shardconsole(*args)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "optim.name" in lines[0] and says in lines[0] and "--set" in lines[0], lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_tiny_fsdp2_run_learns_with_adamw8bit_on_bf16_weights_stepped_in_backward(tmp_path):
    """2 CPU ranks over gloo; torchao's step compiled by Inductor for the CPU, over bf16 FSDP2 shards
    (torchao 0.18 fails that without lowbit_optim.register_view_dtype) and in the backward pass."""
    run_dir = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
                       "--set", "optim.name=adamw8bit", "--set", "train.steps=12", "--set", "train.lr=3e-3",
                       "--set", "precision.dtype=bf16", "--set", "precision.master_dtype=bf16",
                       "--set", "optim.step_in_backward=true", "--set", "train.clip_grad_norm=0",
                       "--set", "train.save_final=none", "--set", "train.log_every=1", timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = of_kind(messages(run_dir), "step")
    losses = [m.loss for m in steps]
    assert [m.step for m in steps] == list(range(1, 13))
    assert losses[-1] < losses[0] - 0.3, losses


def test_tune_holds_the_optimizer_unless_named():
    """optim.name is a numerics key (plan/search.NUMERICS): searched only under `tune --vary optim.name`."""
    from shardconsole import plan as PL
    from shardconsole.plan import search
    from shardconsole.plan.speed.book import SpeedBook
    card = PL.Hardware(gpus=1, gpu_memory_bytes=24 * 2**30, host_memory_bytes=125 * 2**30, gpu_name="NVIDIA H200")
    base = settings.resolve("3090-fsdp", ["precision.master_dtype=bf16"]).cfg
    spec = models.resolve(base.model.name)
    held = search.options(base, spec, card, SpeedBook([]), limit=400)
    assert held and {o.cfg.optim.name for o in held} == {"adamw"}
    named = search.options(base, spec, card, SpeedBook([]), vary={"optim.name"}, limit=400)
    assert {o.cfg.optim.name for o in named} == {"adamw", "adamw8bit", "adamw4bit"}
    low = next(o for o in named if o.cfg.optim.name == "adamw8bit")
    assert search.numerics_changed(low.cfg, base) == ["optim.name"]
    assert "adamw8bit optimizer" in search.numerics_words(low.cfg, base)


def test_planner_holds_one_layers_gradients_when_stepping_in_backward():
    """optim.step_in_backward: each layer's gradients are stepped and freed as they are reduced, so the
    plan keeps one layer's instead of the whole model's, and the GPU peak falls by about the rest."""
    sets = ["model.name=3b", "optim.name=adamw8bit", "precision.master_dtype=bf16", "train.clip_grad_norm=0"]
    spec = models.resolve("3b")
    plain = settings.resolve("3090-fsdp", sets).cfg
    inbwd = settings.resolve("3090-fsdp", [*sets, "optim.step_in_backward=true"]).cfg
    whole = estimator.model_states(plain, spec)["gpu"]["gradients"]
    one = estimator.model_states(inbwd, spec)["gpu"]["gradients"]
    shapes = Shapes.of(spec)
    assert whole == 2 * shapes.n_params                     # bf16 gradients of every parameter (one rank)
    assert one == 2 * max(shapes.per_layer, shapes.root)    # one layer's (or the root's)
    from shardconsole import plan as PL
    card = PL.Hardware(gpus=1, gpu_memory_bytes=141 * 2**30, host_memory_bytes=125 * 2**30, gpu_name="NVIDIA H200")
    plain.memory.gpu_memory_limit = inbwd.memory.gpu_memory_limit = ""       # peaks not clipped at a cap
    a, b = estimator.estimate(plain, spec, card), estimator.estimate(inbwd, spec, card)
    assert a.gpu_peak_bytes - b.gpu_peak_bytes > 0.8 * (whole - one), (a.gpu_peak_bytes, b.gpu_peak_bytes)


def test_tune_holds_the_step_in_backward_unless_named():
    from shardconsole import plan as PL
    from shardconsole.plan import search
    from shardconsole.plan.speed.book import SpeedBook
    card = PL.Hardware(gpus=1, gpu_memory_bytes=24 * 2**30, host_memory_bytes=125 * 2**30, gpu_name="NVIDIA H200")
    base = settings.resolve("3090-fsdp", ["precision.master_dtype=bf16", "train.clip_grad_norm=0"]).cfg
    spec = models.resolve(base.model.name)
    held = search.options(base, spec, card, SpeedBook([]), limit=400)
    assert held and not any(o.cfg.optim.step_in_backward for o in held)
    named = search.options(base, spec, card, SpeedBook([]), vary={"optim.step_in_backward"}, limit=400)
    inbwd = [o for o in named if o.cfg.optim.step_in_backward]
    assert inbwd and all(o.cfg.train.grad_accum == 1 for o in inbwd)     # refused with accumulation
    assert search.numerics_changed(inbwd[0].cfg, base) == ["optim.step_in_backward"]
    assert "step in backward" in inbwd[0].name


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_low_bit_states_take_a_dtype_view_as_the_compiled_step_asks(name):
    """The compiled step on the H200 (torch 2.11, torchao 0.18) asked for aten.view.dtype of a state,
    which torchao does not implement (pytorch/ao#4216): with the shim the view keeps the codes and
    changes only the appearance dtype, as torchao's own _to_copy does."""
    from shardconsole.backends.optim import lowbit_optim
    cfg = settings.resolve("tiny-cpu", [f"optim.name={name}"]).cfg
    p = torch.nn.Parameter(torch.randn(64, 4096, dtype=torch.bfloat16))
    opt = lowbit_optim.make(cfg, [p])
    state = opt._new_buffer(p, True)
    before = state.dequantize().clone()
    v = torch.ops.aten.view.dtype(state, torch.float32)
    assert type(v) is type(state) and v.dtype == torch.float32 and v.shape == state.shape
    assert v.codes.data_ptr() == state.codes.data_ptr()
    assert torch.equal(v.dequantize(), before)
