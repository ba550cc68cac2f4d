"""The fused linear cross-entropy (issue 48 items 2 and 3, backends/model/fused_loss.py) computes what the
chunked one computes: on CPU in fp32 the loss, the hidden states' gradient and the head's gradient equal
modeling.chunked_cross_entropy's to 1e-5, whatever the chunking and the ignored labels; and a real 2-rank
run with memory.loss = "fused" trains step for step as the chunked run of the same seed, under FSDP2 and
under DeepSpeed ZeRO-3 (whose loss reads lm_head.weight outside lm_head's forward)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardconsole.backends.model import fused_loss
from shardconsole.backends.model.fused_loss import fused_linear_cross_entropy
from shardconsole.backends.model.modeling import chunked_cross_entropy
from shardconsole.settings import config as C
from tests.conftest import REPO, messages, of_kind, shardconsole


def _case(seed: int, tokens: int, hidden: int, vocab: int, dtype=torch.float32, ignored: float = 0.2,
          batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, tokens // batch, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype)
    y = torch.randint(0, vocab, (batch, tokens // batch), generator=g)
    y[torch.rand(y.shape, generator=g) < ignored] = -100
    return h, w, y


def _loss_and_grads(fn, h, w, y, chunk_tokens: int, reduction: str = "mean", upstream: float = 1.7):
    """The loss and d(upstream * loss)/d hidden, d weight (an upstream gradient that is not 1 checks the
    backward's scaling)."""
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = fn(h, w, y, chunk_tokens=chunk_tokens, reduction=reduction)
    loss = out[0] if reduction == "sum" else out
    (loss * upstream).backward()
    return out, h.grad, w.grad


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    scale = b.float().abs().max().clamp(min=1e-12)
    assert ((a.float() - b.float()).abs().max() / scale).item() <= rel, (a, b)


@pytest.mark.parametrize("tokens,chunk", [(64, 4096), (64, 64), (100, 16), (130, 32), (257, 50)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_equals_chunked_in_fp32(tokens, chunk, reduction):
    """One chunk, an exact multiple, and token counts that leave a short last chunk; -100 scattered."""
    h, w, y = _case(tokens, tokens - tokens % 2, 24, 97)
    fused, dh, dw = _loss_and_grads(fused_linear_cross_entropy, h, w, y, chunk, reduction)
    ref, rdh, rdw = _loss_and_grads(chunked_cross_entropy, h, w, y, chunk, reduction)
    if reduction == "sum":
        assert torch.equal(fused[1], ref[1]) and fused[1].item() == (y != -100).sum().item()
        fused, ref = fused[0], ref[0]
    _close(fused, ref, 1e-5)
    _close(dh, rdh, 1e-5)
    _close(dw, rdw, 1e-5)
    assert dh.dtype == h.dtype and dw.dtype == w.dtype


def test_a_seeded_sweep_of_shapes():
    """Shapes the parametrised cases do not pick: odd hidden and vocab sizes, chunks of 1 to all tokens."""
    for seed in range(12):
        g = torch.Generator().manual_seed(1000 + seed)
        tokens = 2 * int(torch.randint(1, 90, (), generator=g))
        hidden, vocab = (int(v) for v in torch.randint(3, 70, (2,), generator=g))
        chunk = int(torch.randint(1, tokens + 8, (), generator=g))
        h, w, y = _case(seed, tokens, hidden, vocab, ignored=float(torch.rand((), generator=g)) * 0.6)
        fused, dh, dw = _loss_and_grads(fused_linear_cross_entropy, h, w, y, chunk)
        ref, rdh, rdw = _loss_and_grads(chunked_cross_entropy, h, w, y, chunk)
        for a, b in ((fused, ref), (dh, rdh), (dw, rdw)):
            _close(a, b, 1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_label_ignored_is_zero_loss_and_zero_gradient(reduction):
    h, w, y = _case(3, 40, 16, 50, ignored=1.0)
    out, dh, dw = _loss_and_grads(fused_linear_cross_entropy, h, w, y, 16, reduction)
    loss = out[0] if reduction == "sum" else out
    assert loss.item() == 0.0 and torch.count_nonzero(dh) == 0 and torch.count_nonzero(dw) == 0
    if reduction == "sum":
        assert out[1].item() == 0


def test_bf16_inputs_match_the_chunked_loss_within_bf16_rounding():
    """bf16 hidden and weight (FSDP2's mixed precision): the same fp32 softmax, gradients back in bf16;
    ours sums the head's gradient over the chunks in fp32, the chunked one in bf16."""
    h, w, y = _case(5, 200, 32, 120, dtype=torch.bfloat16)
    fused, dh, dw = _loss_and_grads(fused_linear_cross_entropy, h, w, y, 48)
    ref, rdh, rdw = _loss_and_grads(chunked_cross_entropy, h, w, y, 48)
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16 and fused.dtype == torch.float32
    _close(fused, ref, 1e-3)
    _close(dh, rdh, 2e-2)
    _close(dw, rdw, 2e-2)


def test_fp16_inputs_under_a_loss_scale_match_the_chunked_loss():
    """fp16 hidden and weight under a loss scale (DeepSpeed's fp16, FSDP2's GradScaler): since memory.loss's
    default puts the fused loss on every GPU run, fp16 presets (4090x2-zero3) take it too; the scaled
    gradients stay finite and equal the chunked loss's within fp16's rounding."""
    h, w, y = _case(11, 150, 32, 100, dtype=torch.float16)
    fused, dh, dw = _loss_and_grads(fused_linear_cross_entropy, h, w, y, 40, upstream=1024.0)
    ref, rdh, rdw = _loss_and_grads(chunked_cross_entropy, h, w, y, 40, upstream=1024.0)
    assert dh.dtype == torch.float16 and dw.dtype == torch.float16
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()
    _close(fused, ref, 1e-3)
    _close(dh, rdh, 5e-3)
    _close(dw, rdw, 5e-3)


def test_evaluation_under_no_grad_computes_no_gradient_and_the_same_loss():
    h, w, y = _case(7, 90, 16, 40)
    h.requires_grad_(True)
    w.requires_grad_(True)
    with torch.no_grad():
        total, count = fused_linear_cross_entropy(h, w, y, chunk_tokens=32, reduction="sum")
        ref, ref_count = chunked_cross_entropy(h, w, y, chunk_tokens=32, reduction="sum")
    assert total.grad_fn is None and not total.requires_grad and h.grad is None
    _close(total, ref, 1e-5)
    assert count.item() == ref_count.item()


def test_only_the_gradients_asked_for_are_computed():
    """A frozen head (LoRA) or a hidden state that needs no gradient: the other still equals the chunked one's."""
    h, w, y = _case(9, 60, 16, 30)
    for h_grad, w_grad in ((True, False), (False, True)):
        hh, ww = h.clone().requires_grad_(h_grad), w.clone().requires_grad_(w_grad)
        fused_linear_cross_entropy(hh, ww, y, chunk_tokens=16).backward()
        rh, rw = h.clone().requires_grad_(h_grad), w.clone().requires_grad_(w_grad)
        chunked_cross_entropy(rh, rw, y, chunk_tokens=16).backward()
        got, want = (hh.grad, rh.grad) if h_grad else (ww.grad, rw.grad)
        _close(got, want, 1e-5)
        assert (ww.grad if h_grad else hh.grad) is None


def _graph_names(t: torch.Tensor) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn.name() not in seen:
            seen.add(fn.name())
            todo += [nxt for nxt, _ in fn.next_functions]
    return seen


def test_causal_lm_loss_computes_the_loss_it_was_built_with():
    """CausalLMLoss(lm, loss=...) as the engines build it: "fused" trains through the fused function (and
    gives the chunked loss's value), "chunked" through the checkpointed chunks; per-row log-probs are chunked."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from shardconsole.backends.model.modeling import CausalLMLoss
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2))
    ids = torch.randint(0, 64, (2, 12))
    labels = ids.clone()
    labels[:, :3] = -100
    fused, chunked = CausalLMLoss(lm, loss="fused")(ids, labels), CausalLMLoss(lm)(ids, labels)
    assert "FusedLinearCrossEntropyBackward" in _graph_names(fused)
    assert "FusedLinearCrossEntropyBackward" not in _graph_names(chunked)
    _close(fused, chunked, 1e-5)
    rows, _ = CausalLMLoss(lm, loss="fused")(ids, labels, reduction="row")
    assert "FusedLinearCrossEntropyBackward" not in _graph_names(rows)


def test_the_kernel_is_liger_on_cuda_where_it_imports_and_ours_elsewhere():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert fused_loss.kernel_for(cuda, have_liger=True) == "liger"
    assert fused_loss.kernel_for(cuda, have_liger=False) == "torch"
    assert fused_loss.kernel_for(cpu, have_liger=True) == "torch"
    assert fused_loss.kernel_for(cpu) == "torch"
    assert fused_loss.describe("fused", cpu) == "fused (torch)" and fused_loss.describe("chunked", cpu) == "chunked"


def test_auto_is_fused_on_cuda_and_chunked_on_cpu():
    m = C.RunConfig().memory
    # auto by default since the H200 measured the fused loss faster and leaner (settings/tables.py)
    assert m.loss == "auto"
    assert m.loss_on(True) == "fused" and m.loss_on(False) == "chunked"
    for kind in ("fused", "chunked"):
        m.loss = kind
        assert m.loss_on(True) == kind and m.loss_on(False) == kind


def test_a_bad_memory_loss_is_refused_in_one_line_naming_the_key():
    res = shardconsole("plan", "--preset", "tiny-cpu", "--set", "memory.loss=fastest")
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "memory.loss" in line or "[memory] loss" in line, res.stderr
    assert "fused" in res.stderr and "chunked" in res.stderr, res.stderr


def test_the_gpu_benchmark_runs_on_cpu_at_a_small_size(tmp_path):
    out = tmp_path / "fused.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fused_loss_gpu.py"), "--device", "cpu",
                          "--tokens", "256", "--vocab", "512", "--hidden", "64", "--repeat", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} >= {"chunked", "torch-fused"}
    for r in rows:
        assert r["loss_rel_diff"] < 1e-2 and r["grad_hidden_rel_diff"] < 5e-2 and r["grad_weight_rel_diff"] < 5e-2, r


def test_the_fused_plan_holds_less_for_the_loss_than_the_chunked_one():
    """7B-shaped (vocab 32000, hidden 4096), seq 2048 x micro-batch 8, bf16 on CUDA: liger keeps its
    gradients (no logits) from forward to backward, the chunked loss recomputes 4096 tokens' fp32
    logits and their gradients in backward. An order, not a value: the GPU measures the values."""
    from shardconsole import plan as PL
    from shardconsole.settings.models import resolve

    def planned(loss: str, *sets: str, objective: str = "sft"):
        cfg = C.build({"model": {"name": "7b"}, "data": {"seq_len": 2048}, "parallel": {"device": "cuda"}}, "test",
                      ["train.micro_batch=8", "precision.dtype=bf16", f"memory.loss={loss}", *sets])
        cfg.train.objective = objective     # (a preference run needs a pairs file to build; its activations don't)
        a = PL.activations(cfg, PL.Shapes.of(resolve("7b")))
        if objective != "sft":
            return a.loss_forward, a.loss_backward
        e = PL.estimate(cfg, resolve("7b"), PL.Hardware(gpus=1, gpu_memory_bytes=150 * 2**30,
                                                         host_memory_bytes=512 * 2**30))
        return max(a.loss_forward, a.loss_backward), max(e.gpu_phases.get("end of forward", 0), e.gpu_phases.get("loss backward", 0))

    for sets in ((), ("memory.activation_checkpointing=true",), ("parallel.backend=deepspeed", "deepspeed.stage=3")):
        fused, chunked = planned("fused", *sets), planned("chunked", *sets)
        assert fused[0] < chunked[0] and fused[1] < chunked[1], sets
        assert planned("auto", *sets) == fused, sets
    # LoRA's frozen head takes no gradient: no fp32 [vocab, hidden] accumulator (4 V h: 0.49 GiB here), nor its cast
    full, lora = planned("fused"), planned("fused", "train.method=lora")
    assert full[0] - lora[0] >= 4 * 32000 * 4096
    assert planned("fused", "train.method=lora", "lora.modules_to_save=lm_head")[0] == full[0]
    # a preference objective reads per-row log-probs: chunked whatever memory.loss says
    assert planned("fused", objective="dpo") == planned("chunked", objective="dpo")


# ---------------------------------------------------------------------------------------------------
# Real 2-rank CPU runs: memory.loss = "fused" against "chunked", same seed, same steps.

RUN_TIMEOUT = 900       # a cold machine builds DeepSpeed's ops inside its first DeepSpeed run
STEPS = ["train.steps=6", "train.log_every=1", "train.warmup_steps=1"]


def _run(root: Path, name: str, loss: str, *backend: str) -> SimpleNamespace:
    run = root / name
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *[a for s in (*STEPS, f"memory.loss={loss}", *backend) for a in ("--set", s)],
                       timeout=RUN_TIMEOUT, env={"DS_ACCELERATOR": "cpu"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    losses = {m.step: m.loss for m in of_kind(messages(run), "step")}
    log = (run / "logs" / "rank0.log").read_text()
    return SimpleNamespace(losses=losses, log=log)


@pytest.mark.parametrize("backend,rel", [((), 1e-4), (("parallel.backend=deepspeed", "deepspeed.stage=3"), 1e-4),
                                         (("precision.dtype=bf16",), 1e-3)], ids=["fsdp", "zero3", "fsdp-bf16"])
def test_a_fused_run_trains_as_the_chunked_run(tmp_path, backend, rel):
    """fp32: the same numbers to float rounding; bf16 (FSDP2's mixed precision: bf16 hidden states and head,
    gradients handed back in bf16) within bf16's rounding of the gradients over 6 steps."""
    fused = _run(tmp_path, "fused", "fused", *backend)
    chunked = _run(tmp_path, "chunked", "chunked", *backend)
    # the engine built the loss asked for (the same rule decides the line and the loss)
    assert "loss: fused (torch)" in fused.log and "loss: chunked" in chunked.log
    assert sorted(fused.losses) == sorted(chunked.losses) == list(range(1, 7))
    for step, want in chunked.losses.items():
        assert abs(fused.losses[step] - want) <= rel * abs(want), (step, fused.losses, chunked.losses)
    # and it trained: the loss moved (a fused gradient of zero would leave it where it started)
    assert fused.losses[6] < fused.losses[1] - 1e-3, fused.losses
