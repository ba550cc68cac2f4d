"""precision.master_rounding: the bf16 update against an fp64 AdamW reference on small tensors, the
stochastic rounding itself, and the fp16-only keys of a preset under a dtype override."""

from __future__ import annotations

import pytest
import torch

from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.backends.optim.master_update import RoundedAdamW, round_stochastic_

N, STEPS, LR = 2048, 600, 1e-4


@pytest.fixture(scope="module")
def runs():
    """The same AdamW run (weights near 1.25, gradients of one sign, so each update is about lr: 1/30 of
    half a bf16 step at 1.25) in float64 and in bf16 under each rounding."""
    gen = torch.Generator().manual_seed(0)
    # bf16 values to start from and as gradients: every run sees the same numbers
    w0 = (1.0 + 0.5 * torch.rand(N, generator=gen)).bfloat16().float()
    grads = [(0.5 + 0.5 * torch.rand(N, generator=gen)).bfloat16().float() for _ in range(16)]
    out = {}
    for kind in ("fp64", "nearest", "stochastic", "kahan"):
        if kind == "fp64":
            p = torch.nn.Parameter(w0.double())
            opt = torch.optim.AdamW([p], lr=LR, weight_decay=0.1, foreach=False)
        elif kind == "nearest":
            p = torch.nn.Parameter(w0.bfloat16())
            opt = torch.optim.AdamW([p], lr=LR, weight_decay=0.1, fused=True)
        else:                       # chunk 700: several chunks a tensor, the last one short
            p = torch.nn.Parameter(w0.bfloat16())
            opt = RoundedAdamW([p], lr=LR, weight_decay=0.1, rounding=kind, seed=3, chunk=700)
        for i in range(STEPS):
            p.grad = grads[i % len(grads)].to(p.dtype)
            opt.step()
        out[kind] = (p.detach().double(), opt.state[p]["exp_avg_sq"].double())
    return w0.double(), out


def test_nearest_loses_the_updates_the_compensated_ones_keep(runs):
    w0, out = runs
    ref, v_ref = out["fp64"]
    moved = float((ref - w0).abs().mean())
    assert moved > 0.05
    err = {k: (out[k][0] - ref) for k in ("nearest", "stochastic", "kahan")}
    # nearest: every update rounds back to the old weight
    assert float(err["nearest"].abs().mean()) > 0.95 * moved
    # kahan: within one bf16 step of the fp64 weight, element by element (half a step of rounding, the
    # rest from the stochastically rounded moments)
    assert float((err["kahan"].abs() / ref.abs()).max()) <= 2 ** -7
    assert float(err["kahan"].abs().mean()) < 0.05 * moved
    # stochastic: each weight a random walk around the reference, unbiased on average
    assert abs(float(err["stochastic"].mean())) < 0.02 * moved
    assert float(err["stochastic"].abs().mean()) < 0.3 * moved
    # Adam's second moment: 0.999 * v rounds back to v under nearest; stochastic rounding tracks it
    rel = {k: float(((out[k][1] - v_ref) / v_ref).mean()) for k in ("nearest", "stochastic", "kahan")}
    assert abs(rel["nearest"]) > 0.1
    assert abs(rel["stochastic"]) < 0.01 and abs(rel["kahan"]) < 0.01


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    hi = torch.nextafter(lo, torch.tensor(2.0, dtype=torch.bfloat16))
    fracs = torch.tensor([0.0, 0.1, 0.25, 0.5, 0.9])
    x = (float(lo) + fracs * (float(hi) - float(lo))).float()
    x = torch.cat([x, -x])
    ups = torch.zeros_like(x, dtype=torch.float64)
    trials = 4000
    out = torch.empty_like(x, dtype=torch.bfloat16)
    for seed in range(trials):
        round_stochastic_(x.clone(), out, seed * 7919 - 2**30)
        assert bool(((out.abs() == lo) | (out.abs() == hi)).all())
        ups += (out.abs() == hi).double()
    want = torch.cat([fracs, fracs]).double()
    assert float((ups / trials - want).abs().max()) < 0.03
    # deterministic for a seed
    a, b = torch.empty_like(out), torch.empty_like(out)
    round_stochastic_(x.clone(), a, 5)
    round_stochastic_(x.clone(), b, 5)
    assert torch.equal(a, b)


def test_grad_scale_divides_the_gradients_as_fused_adamw_does():
    """fsdp_step folds the clip into grad_scale: the rounded optimizer must apply it."""
    gen = torch.Generator().manual_seed(1)
    w, g = torch.randn(3000, generator=gen).bfloat16(), torch.randn(3000, generator=gen).bfloat16()
    moments = []
    for scale in (None, torch.tensor(10.0)):
        p = torch.nn.Parameter(w.clone())
        opt = RoundedAdamW([p], lr=1e-3, rounding="kahan")
        opt.grad_scale = scale
        p.grad = g.clone()
        opt.step()
        moments.append(opt.state[p]["exp_avg"].float())
    torch.testing.assert_close(moments[1] * 10, moments[0], rtol=2 ** -6, atol=0)


def test_dtype_override_ignores_the_presets_fp16_keys_with_a_note(tmp_path):
    r = settings.resolve("4090x2-zero3", ["precision.dtype=bf16"])
    assert r.cfg.precision.dtype == "bf16" and r.cfg.precision.loss_scale_window is None
    assert any("precision.loss_scale_window = 100 ignored" in n and "--set precision.dtype" in n for n in r.notes)
    # an fp16 key the override itself sets, or a preset that contradicts itself, is still refused
    with pytest.raises(C.ConfigError) as e:
        settings.resolve("4090x2-zero3", ["precision.dtype=bf16", "precision.loss_scale_window=5"])
    assert e.value.source == "--set precision.loss_scale_window"
    p = tmp_path / "mixed.toml"
    p.write_text('[precision]\ndtype = "bf16"\nloss_scale_window = 100\n')
    with pytest.raises(C.ConfigError):
        settings.resolve(str(p))


@pytest.mark.parametrize("master", ["fp32", "nearest", "stochastic", "kahan"])
def test_planner_bytes_per_parameter_are_what_the_optimizer_keeps(master):
    """plan/constants.MASTER_STATE_BYTES against the tensors a step leaves: the weight, its gradient and
    every optimizer state tensor shaped like it, for the optimizer fsdp.make_optimizer picks."""
    from shardconsole.backends.offload import pinned_arena
    from shardconsole.plan import constants
    n = 1000
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
    opt = (torch.optim.AdamW([p], fused=True) if master in ("fp32", "nearest")
           else RoundedAdamW([p], rounding=master))
    p.grad = torch.ones(n, dtype=dtype)
    opt.step()
    kept = [p, p.grad, *(t for t in opt.state[p].values() if t.shape == p.shape)]
    assert sum(t.numel() * t.element_size() for t in kept) / n == constants.MASTER_STATE_BYTES[master]
    # the host arena reserves one slot per state the optimizer keeps
    assert set(pinned_arena.STATE_NAMES[master]) == {k for k, t in opt.state[p].items() if t.shape == p.shape}
    assert constants.HOST_ARENA_ALIGN == pinned_arena.ALIGN


def test_rounding_without_bf16_masters_is_noted():
    r = settings.resolve("tiny-cpu", ["precision.master_rounding=kahan"])
    assert any("master_rounding = 'kahan' has no effect" in n for n in r.notes)
    assert not any("master_rounding" in n for n in settings.resolve("tiny-cpu").notes)
    with pytest.raises(C.ConfigError) as e:
        settings.resolve("tiny-cpu", ["precision.master_rounding=round"])
    assert e.value.source == "--set precision.master_rounding" and "stochastic" in str(e.value)


def test_dtype_override_of_an_fp16_preset_writes_a_run_without_its_fp16_keys(tmp_path):
    """The issue's case through the CLI: 4090x2-zero3 (fp16, loss_scale_window = 100) with
    `--set precision.dtype=bf16` is accepted with the note, and the run folder's settings drop the key."""
    from tests.conftest import shardconsole
    run_dir = tmp_path / "run"
    res = shardconsole("--preset", "4090x2-zero3", "--print-command", "--run-dir", str(run_dir),
                       "--set", "precision.dtype=bf16", timeout=60)
    assert res.returncode == 0, res.stderr
    assert "precision.loss_scale_window = 100 ignored" in res.stderr
    saved = C.load(run_dir / "preset.toml")
    assert saved.precision.dtype == "bf16" and saved.precision.loss_scale_window is None


@pytest.mark.parametrize("master", ["fp32", "nearest", "stochastic", "kahan"])
def test_planner_counts_each_rounding_in_the_host_arena(master):
    """`shardconsole plan`'s host parts for an offloaded 7B run: the shards, Adam's states and the Kahan
    buffer sit in the arena at their exact size, MASTER_STATE_BYTES a parameter less the gradient (which
    torch still pins in power-of-two blocks, counted apart)."""
    from shardconsole import plan as PL
    from shardconsole.settings.models import resolve
    from shardconsole.plan import constants
    sets = ["fsdp.cpu_offload=true", "memory.activation_checkpointing=true"]
    if master != "fp32":
        sets += ["precision.master_dtype=bf16", f"precision.master_rounding={master}"]
    cfg = C.build({"model": {"name": "7b"}, "data": {"seq_len": 2048}, "parallel": {"device": "cuda"}}, "t", sets)
    spec = resolve("7b")
    est = PL.estimate(cfg, spec, PL.Hardware(gpus=1, gpu_memory_bytes=24 * 2**30, host_memory_bytes=125 * 2**30))
    parts = est.host_parts
    grad = 4 if master == "fp32" else 2
    kept = sum(v for k, v in parts.items() if "host arena" in k or "Kahan" in k)
    n = sum(v for k, v in parts.items() if k.startswith("parameters")) / grad     # the parameters, padded
    assert kept / n == pytest.approx(constants.MASTER_STATE_BYTES[master] - grad, rel=1e-3)
    assert any(k.startswith("gradients") and "pinned" in k for k in parts)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_the_compiled_update_compiles_once_for_every_shape_and_matches_eager(rounding):
    """The host step of an offloaded run, compiled as it runs there: tensors of several shapes (a 2-D weight,
    a 1-D norm, a chunked one with a short tail) go through one compiled graph. A second graph for a later
    shape was the 4.8 s step at 1B on the GPU machine (its kernel ran on one thread); its results are the
    eager update's, to a bf16 step."""
    from torch._dynamo.utils import counters
    from shardconsole.backends.optim import master_update
    torch._dynamo.reset()
    master_update._COMPILED.clear()
    gen = torch.Generator().manual_seed(2)
    shapes = [(64, 48), (48,), (3000,), (7, 5)]
    w0 = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    grads = [[torch.randn(s, generator=gen).bfloat16() for s in shapes] for _ in range(3)]
    out = {}
    for compiled in (False, True):
        ps = [torch.nn.Parameter(w.clone()) for w in w0]
        # host_op=False: Inductor's update (the fallback where the C++ op cannot be built)
        opt = RoundedAdamW(ps, lr=1e-2, rounding=rounding, seed=4, chunk=1024, compile=compiled, host_op=False)
        before = counters["stats"]["unique_graphs"]
        for g in grads:
            for p, gi in zip(ps, g):
                p.grad = gi.clone()
            opt.step()
        assert not opt.compile_failed
        out[compiled] = [p.detach().float() for p in ps]
        if compiled:
            assert counters["stats"]["unique_graphs"] - before == 1
    # compiled and eager may differ by an fp32 ulp, which picks other random bits: after three steps a
    # few bf16 steps apart at most (rtol: four), or 1% of one update (lr 1e-2) for weights near zero,
    # and on average far less than the updates themselves
    for eager, comp, w in zip(out[False], out[True], w0):
        moved = float((eager - w.float()).abs().mean())
        assert moved > 1e-3                                        # the update moved the weights
        torch.testing.assert_close(comp, eager, rtol=2 ** -5, atol=1e-4)
        assert float((comp - eager).abs().mean()) < 0.1 * moved


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_the_cpp_host_step_rounds_as_the_python_one_and_matches_eager(rounding):
    """backends/optim/rounded_update_cpu.py, the host step of an offloaded run with bf16 masters (issue 35):
    the rounding is master_update's bit for bit; three steps of the update agree with eager to a bf16 step
    (an fp32 ulp apart where eager fuses a multiply-add picks other random bits, as compiled does); the
    same seeds give the same weights (a resumed run rounds alike)."""
    from shardconsole.backends.optim import rounded_update_cpu
    built, why = rounded_update_cpu.get()
    assert built is not None, why
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(3)) * 3
    for seed in (0, 5, -2**30, 2**31 - 1):
        a, b = torch.empty(x.numel(), dtype=torch.bfloat16), torch.empty(x.numel(), dtype=torch.bfloat16)
        round_stochastic_(x.clone(), a, seed)
        built.round_stochastic(x, b, seed)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), seed
    gen = torch.Generator().manual_seed(2)
    shapes = [(64, 48), (48,), (3000,)]
    w0 = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    grads = [[torch.randn(s, generator=gen).bfloat16() for s in shapes] for _ in range(3)]
    out = []
    for how in ("eager", "c++", "c++"):
        ps = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = RoundedAdamW(ps, lr=1e-2, rounding=rounding, seed=4, chunk=1024, compile=how != "eager")
        if how != "eager":
            assert opt._fn("cpu") is rounded_update_cpu.update_chunk
        for g in grads:
            for p, gi in zip(ps, g):
                p.grad = gi.clone()
            opt.step()
        out.append([p.detach().float() for p in ps])
    for eager, op, again, w in zip(*out, w0):
        assert torch.equal(op, again)
        moved = float((eager - w.float()).abs().mean())
        assert moved > 1e-3
        torch.testing.assert_close(op, eager, rtol=2 ** -5, atol=1e-4)
        assert float((op - eager).abs().mean()) < 0.1 * moved
