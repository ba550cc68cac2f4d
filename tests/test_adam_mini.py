"""optim.name = "adam-mini" (issue 60): the split fp32 masters, the host op against the torch update, the
update's quality against fp32-master AdamW on a small model and data made here, a real offloaded 2-rank
run (save, resume on another rank count, export of the exact fp32 masters), the planner's bytes against
the arena's, and the presets of the consumer box planned on a 3090 with their hosts."""

from __future__ import annotations

import copy
import json
import re
import struct

import pytest
import torch

from shardconsole.backends.optim import adam_mini, adam_mini_cpu
from shardconsole.backends.optim.adam_mini import AdamMini
from tests.conftest import messages, of_kind, shardconsole

GIB = 2**30


def _values(n: int, seed: int) -> torch.Tensor:
    """fp32 values of every kind a weight takes: signs, magnitudes from 1e-30 to 1e3, exact bf16 halfway
    cases (low 16 bits 0x8000), exact bf16 values and zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.empty(n).uniform_(-69, 7, generator=gen))
    ties = torch.randint(0x3000, 0x4800, (n // 8,), generator=gen, dtype=torch.int32) << 16 | 0x8000   # finite
    x[: n // 8] = ties.view(torch.float32)
    x[n // 8: n // 4] = x[n // 8: n // 4].bfloat16().float()
    x[-1] = 0.0
    return x


def test_split_masters_join_back_bit_for_bit_and_the_bf16_part_is_the_nearest():
    x = _values(1 << 16, 0)
    hi, low = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.int16)
    adam_mini.split_(x, hi, low)
    assert torch.equal(adam_mini.join(hi, low).view(torch.int32), x.view(torch.int32))
    # within half a bf16 step of the fp32 value (ties away from zero), so the gathered weight is the
    # master rounded to nearest
    err = (hi.float() - x).abs()
    half_step = (x.abs() * 2.0 ** -8).clamp_min(torch.finfo(torch.float32).tiny)
    assert bool((err <= half_step).all())


def test_updates_far_below_a_bf16_step_add_up_in_the_split_masters():
    """A bf16 weight of 1.0 takes 1000 updates of 1e-5 (a bf16 step at 1.0 is 2**-7 = 0.0078): AdamW
    on bf16 weights rounds each back; the split master holds every one."""
    w = torch.ones(4096)
    kept, plain, ref = (torch.nn.Parameter(w.bfloat16()), torch.nn.Parameter(w.bfloat16()),
                        torch.nn.Parameter(w.clone()))
    mini = AdamMini([kept], lr=1e-5, weight_decay=0.0, split=True, host_op=False)
    nearest = torch.optim.AdamW([plain], lr=1e-5, weight_decay=0.0)
    fp32 = torch.optim.AdamW([ref], lr=1e-5, weight_decay=0.0)
    for _ in range(1000):
        for p in (kept, plain, ref):
            p.grad = torch.ones_like(p)
        for opt in (mini, nearest, fp32):
            opt.step()
    master = adam_mini.join(kept.detach(), mini.state[kept]["weight_low"])
    assert abs(float(ref.detach()[0]) - 0.99) < 1e-4
    # the rest: the first moment in bf16 (rounded stochastically: unbiased, a little noise), 0.1% of the move
    assert torch.allclose(master, ref.detach(), rtol=0, atol=1e-5)
    assert bool((plain.detach().float() == 1.0).all())


def test_a_loaded_state_keeps_each_tensor_in_its_own_dtype_and_steps_on_as_the_saved_one():
    """torch's Optimizer.load_state_dict casts every floating state to its parameter's dtype: on bf16 weights
    the fp32 second moment came back bf16 and the resumed step failed ("v is fp32"; found by the combination
    matrix: LoRA, offload, bf16 masters, a resume). Loaded, each state has its dtype and value, and the next
    step equals the uninterrupted optimizer's bit for bit."""
    torch.manual_seed(0)
    start = torch.randn(8, 32).bfloat16()
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    first = AdamMini([a], lr=1e-3, weight_decay=0.01, split=True, host_op=False)
    grads = [torch.randn(8, 32).bfloat16() for _ in range(3)]
    for g in grads[:2]:
        a.grad = g.clone()
        first.step()
    b.data.copy_(a.data)
    again = AdamMini([b], lr=1e-3, weight_decay=0.01, split=True, host_op=False)
    again.load_state_dict(copy.deepcopy(first.state_dict()))     # as from a checkpoint: tensors of its own
    for name, t in first.state[a].items():
        assert again.state[b][name].dtype == t.dtype and torch.equal(again.state[b][name], t), name
    assert again.state[b]["exp_avg_sq_row"].dtype == torch.float32
    a.grad, b.grad = grads[2].clone(), grads[2].clone()
    first.step()
    again.step()
    assert torch.equal(a.detach(), b.detach())
    assert torch.equal(first.state[a]["weight_low"], again.state[b]["weight_low"])


@pytest.mark.parametrize("kind", ["split", "stochastic", "fp32"])
@pytest.mark.parametrize("shape", [(96, 257), (1000,)])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_the_host_op_is_the_torch_update(kind, shape, grad_dtype):
    mod, why = adam_mini_cpu.get()
    assert mod is not None, why         # CI's machines and the GPU machines have a compiler
    gen = torch.Generator().manual_seed(1)
    w32 = torch.randn(shape, generator=gen) * 0.02
    rows = shape[0]
    g = (torch.randn(shape, generator=gen)).to(grad_dtype)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    m = (torch.randn(shape, generator=gen) * 0.01).to(dtype)
    v = torch.rand(rows, generator=gen) * 1e-3
    hi, low = w32.to(dtype), torch.zeros(shape, dtype=torch.int16)
    if kind == "split":
        adam_mini.split_(w32, hi, low)
    hp = adam_mini.hyper_parameters(1e-3, 0.9, 0.999, 0.01, 1e-8, 7.0, 1.0)
    two = lambda t: t.view(-1, t.shape[-1]) if t.dim() >= 2 else t.view(-1, 1)  # noqa: E731
    a = [hi.clone(), g, m.clone(), v.clone(), low.clone()]
    b = [hi.clone(), g, m.clone(), v.clone(), low.clone()]
    split = kind == "split"
    adam_mini.update_torch(two(a[0]), two(a[1]), two(a[2]), a[3], two(a[4]) if split else None, hp, 11, 12)
    mod.update(two(b[0]), two(b[1]), two(b[2]), b[3], two(b[4]) if split else torch.empty(0, dtype=torch.int16),
               torch.tensor(hp), 11, 12)
    # v: the row's sum runs in another order (an fp32 rounding or two); the moment: the same bits
    torch.testing.assert_close(a[3], b[3], rtol=2e-6, atol=0)
    assert torch.equal(a[2], b[2])
    wa = adam_mini.join(a[0], a[4]) if split else a[0].float()
    wb = adam_mini.join(b[0], b[4]) if split else b[0].float()
    moved = (wa - w32).abs().max()
    if kind == "stochastic":        # an ulp of difference may pick the other bf16 neighbour
        assert float((wa != wb).float().mean()) < 0.05
        assert float((wa - wb).abs().max()) <= float(wa.abs().max()) * 2.0 ** -7
    else:
        assert float((wa - wb).abs().max()) <= 1e-5 * float(moved)


# ---------------------------------------------------------------------------------------------------
# Quality: a small Llama pretrained on one Markov chain, then fine-tuned on another; the held-out loss
# after the fine-tune with each update rule (bf16 compute throughout, as FSDP2's mixed precision runs).

V, T = 64, 32


def _chain_data(seed: int, n: int, chain_seed: int) -> torch.Tensor:
    nxt = torch.randint(0, V, (V, 2), generator=torch.Generator().manual_seed(chain_seed))
    gen = torch.Generator().manual_seed(seed)
    x = torch.empty(n, T, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (n,), generator=gen)
    for t in range(1, T):
        x[:, t] = nxt[x[:, t - 1], torch.randint(0, 2, (n,), generator=gen)]
    return x


def _train(model, opt, data, steps: int, lr: float, autocast: bool, bs: int = 16) -> None:
    for s in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (s + 1) / 10)
        batch = data[(s * bs) % len(data):][:bs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def fine_tunes():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=T, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    _train(base, torch.optim.AdamW(base.parameters(), lr=3e-3, weight_decay=0.0), _chain_data(3, 2048, 1),
           200, 3e-3, autocast=True)
    start = {k: v.clone() for k, v in base.state_dict().items()}
    tune, held = _chain_data(4, 2048, 2), _chain_data(5, 256, 2)
    out = {}
    for kind in ("fp32 adamw", "adam-mini", "adam-mini bf16", "bf16 adamw"):
        model = LlamaForCausalLM(cfg)
        model.load_state_dict(start)
        fp32 = kind == "fp32 adamw"
        if not fp32:
            model.to(torch.bfloat16)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0) if "adamw" in kind else
               AdamMini(model.parameters(), lr=1e-3, weight_decay=0.0, split=kind == "adam-mini"))
        _train(model, opt, tune, 150, 1e-3, autocast=fp32)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=fp32):
            out[kind] = model(input_ids=held, labels=held).loss.item()
    return out


def test_adam_mini_ends_within_2_percent_of_fp32_master_adamw(fine_tunes):
    ref = fine_tunes["fp32 adamw"]
    assert ref < 0.9          # it learned the new chain (its floor is ln 2 = 0.69; a uniform guess 4.16)
    assert fine_tunes["adam-mini"] <= 1.02 * ref, fine_tunes
    assert fine_tunes["adam-mini bf16"] <= 1.02 * ref, fine_tunes
    # the measure tells update rules apart: AdamW on bf16 weights (updates rounded to nearest) is outside it
    assert fine_tunes["bf16 adamw"] > 1.02 * ref, fine_tunes


# ---------------------------------------------------------------------------------------------------
# The real thing: 2 CPU ranks over gloo, offloaded, split masters (bf16 compute)

SETS = ["optim.name=adam-mini", "fsdp.cpu_offload=true", "train.clip_grad_norm=0", "precision.dtype=bf16",
        "train.steps=12", "train.log_every=1", "train.lr=3e-3"]


def _run(tmp_path, name, *sets):
    run_dir = tmp_path / name
    args = ["--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    return run_dir, shardconsole(*args, timeout=600)


def _safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    return head, raw[8 + n:]


@pytest.mark.slow
def test_an_offloaded_run_learns_resumes_on_one_rank_and_exports_its_fp32_masters(tmp_path):
    run_dir, res = _run(tmp_path, "run", *SETS, "train.export_dtype=fp32", f"train.export_dir={tmp_path / 'out'}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    losses = [m.loss for m in of_kind(messages(run_dir), "step")]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5, losses
    log = (run_dir / "logs" / "rank0.log").read_text()
    # the arena holds bf16 shards and adam-mini's states: 6 bytes a parameter, no compute copy
    arena = re.search(r"host arena: .*?shards ([\d.]+) (KiB|MiB), optimizer states ([\d.]+) (KiB|MiB)", log)
    assert arena and "compute copy" not in arena.group(0), log[-2000:]
    shards, states = float(arena.group(1)), float(arena.group(3))
    assert 1.9 < states / shards < 2.2        # weight_low + exp_avg (2 + 2 bytes) against the bf16 shard's 2
    # the export: fp32, the masters joined from the optimizer's remainders, not the bf16 weights widened
    head, data = _safetensors(tmp_path / "out" / "model.safetensors")
    name, info = next((k, v) for k, v in head.items() if k.endswith("q_proj.weight"))
    assert info["dtype"] == "F32"
    lo, hi = info["data_offsets"]
    w = torch.frombuffer(bytearray(data[lo:hi]), dtype=torch.float32)
    assert float((w.view(torch.int32) & 0xFFFF != 0).float().mean()) > 0.5     # low bits a bf16 cannot hold
    # resume on one rank: DCP reshards the states (the rows' second moment too) and training goes on
    res = shardconsole("resume", str(run_dir), "--set", "train.steps=16", "--set", "parallel.nproc_per_node=1",
                       "--set", "train.export_dir=",
                       timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = of_kind(messages(run_dir), "step")
    assert [m.step for m in steps][-4:] == [13, 14, 15, 16]
    assert steps[-1].loss < losses[-1] + 0.3, [m.loss for m in steps]


@pytest.mark.parametrize("sets, key", [
    (["parallel.backend=deepspeed"], "optim.name"),
    (["precision.dtype=bf16", "precision.master_dtype=bf16", "precision.master_rounding=kahan"],
     "master_rounding"),
    (["precision.dtype=bf16", "precision.master_dtype=bf16"], "optim.name"),
])
def test_what_adam_mini_cannot_run_is_refused_in_one_line(tmp_path, sets, key):
    run_dir, res = _run(tmp_path, "run", "optim.name=adam-mini", *sets)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and key in lines[0], lines
    assert not (run_dir / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------------
# The planner

def test_the_plan_counts_the_bytes_the_arena_holds(tmp_path):
    """tiny on 2 ranks, offloaded with split masters: the plan's optimizer states and shards against the
    arena's own line, byte for byte but for the 4 KiB alignment of each view."""
    from shardconsole import plan as PL
    from shardconsole.settings import preset_store
    from shardconsole.settings.models import resolve
    cfg = preset_store.load("tiny-cpu", SETS)
    parts = PL.estimate(cfg, resolve("tiny"), PL.Hardware(gpus=0, gpu_memory_bytes=0, host_memory_bytes=24 * GIB)).host_parts
    states = next(v for k, v in parts.items() if k.startswith("optimizer states (adam-mini"))
    shards = next(v for k, v in parts.items() if k.startswith("parameters (bf16 shards"))
    run_dir, res = _run(tmp_path, "run", *SETS, "train.steps=1", "train.save_final=none")
    assert res.returncode == 0, res.stderr[-2000:]
    line = re.search(r"shards ([\d.]+) MiB, optimizer states ([\d.]+) MiB",
                     (run_dir / "logs" / "rank0.log").read_text())
    assert line
    # both ranks' (the plan's parts are the node's); the arena aligns each view to 4 KiB
    n_views = 2 * 3 * 21
    assert abs(2 * float(line.group(2)) * 2**20 - states) <= n_views * 4096 + 0.01 * states
    assert abs(2 * float(line.group(1)) * 2**20 - shards) <= n_views * 4096 / 3 + 0.01 * shards


@pytest.mark.parametrize("preset, host, model, bytes_per_param", [
    ("3090-8b-64gb", 64, "llama3-8b", 6), ("3090-14b-96gb", 96, "qwen3-14b", 4),
    ("3090-24b-128gb", 128, "mistral-small-24b", 4)])
def test_the_consumer_presets_fit_a_3090_and_their_box(preset, host, model, bytes_per_param):
    res = shardconsole("plan", "--preset", preset, "--card", "rtx3090", "--host-memory", f"{host}GiB",
                       "--host-cores", "16", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["fits"], doc.get("verdict")
    from shardconsole.settings.models import resolve
    n = resolve(model).n_params
    states = sum(v for k, v in doc["host_parts"].items() if k.startswith(("parameters", "optimizer states")))
    assert abs(states / n - bytes_per_param) < 0.02, states / n
    assert doc["host_peak_bytes"] <= host * GIB


def test_a_host_cap_below_the_plan_does_not_fit_and_names_the_cap():
    """On a 3090 with a 64 GiB host, 3090-8b-64gb capped at 40 GiB: the plan's verdict names the setting
    (the launch's refusal is the same verdict's: tests/test_host_limit.py runs it for real)."""
    res = shardconsole("plan", "--preset", "3090-8b-64gb", "--card", "rtx3090", "--host-memory", "64GiB",
                       "--set", "memory.host_memory_limit=40GiB")
    assert res.returncode == 3, res.stderr         # plan's exit status for a run that does not fit
    verdict = next(line for line in res.stdout.splitlines() if line.startswith("verdict:"))
    assert "does not fit" in verdict and "memory.host_memory_limit" in verdict, verdict


def test_plan_fit_lists_the_consumer_presets_for_their_box():
    res = shardconsole("plan", "--fit", "--card", "rtx3090", "--host-memory", "64GiB", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    names = [p["name"] for p in doc["presets_that_fit"]]
    assert "3090-8b-64gb" in names and "3090-14b-96gb" not in names
    row = next(r for r in doc["fit_table"] if r["strategy"] == "offload + adam-mini")
    assert row["n_params"] >= 8.0e9
    plain = next(r for r in doc["fit_table"] if r["strategy"] == "full_shard+offload")
    assert plain["n_params"] < 7e9           # fp32-master AdamW: no 8B on a 64 GB box
