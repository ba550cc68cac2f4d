"""Real DeepSpeed runs through the real headless path: `shardconsole --headless` starts torchrun (or the
deepspeed launcher), 2 CPU ranks over gloo run DeepSpeed's ZeRO engine on the tiny model.

The first offloaded DeepSpeed run on a machine JIT-builds CPUAdam (~110 s on 2 cores, shown as the phase
"building ops"; cached in ~/.cache/torch_extensions), so later runs take 10-30 s each. DeepSpeed's CPU
comm op (shm_comm, ~60 s more) is not built: ZeRO training does not use it (deepspeed.skip_shm_comm_op).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from shardconsole.settings import config as C
from shardconsole.headless import EXIT_CODES
from shardconsole.runlog.runfolder import PRESET_FILE, RunFolder
from tests.conftest import assert_nothing_left, messages, of_kind, shardconsole, wait_for_steps

RUN_TIMEOUT = 900     # a cold machine builds DeepSpeed's ops inside the first run


def run(run_dir: Path, *sets: str, preset: str = "tiny-cpu"):
    args = ["--preset", preset, "--headless", "--run-dir", str(run_dir), "--set", "parallel.backend=deepspeed"]
    for s in sets:
        args += ["--set", s]
    return shardconsole(*args, timeout=RUN_TIMEOUT)


def events(msgs, name):
    return [m for m in msgs if m.kind == "event" and m.name == name]


def assert_clean_run(res, run_dir: Path) -> list:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + _logs(run_dir)
    msgs = messages(run_dir)
    assert len(of_kind(msgs, "finished")) == 1 and not of_kind(msgs, "failed")
    hellos = of_kind(msgs, "hello")
    assert {h.rank for h in hellos} == {0, 1} and {h.backend for h in hellos} == {"deepspeed"}
    assert_nothing_left(run_dir, msgs)
    return msgs


def _logs(run_dir: Path) -> str:
    out = []
    for f in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
        out.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-3000:])
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------
# TORCH_CUDA_ARCH_LIST (no GPU needed: DeepSpeed's own parser decides)

def test_arch_list_fix():
    from shardconsole.backends.engine.deepspeed import fix_cuda_arch_list
    assert fix_cuda_arch_list("9.0a") == "9.0"
    assert fix_cuda_arch_list("8.0;9.0a") == "8.0;9.0"
    assert fix_cuda_arch_list("8.0 9.0a 10.0a+PTX") == "8.0;9.0;10.0+PTX"
    assert fix_cuda_arch_list("9.0a;9.0") == "9.0"
    assert fix_cuda_arch_list("8.6") is None and fix_cuda_arch_list("8.0;9.0+PTX") is None


def test_deepspeed_builder_parses_the_fixed_arch_list(monkeypatch):
    """DeepSpeed's CUDA op builder itself: "9.0a" crashes it (docs/MEASURED.md), the fixed value parses."""
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder
    from shardconsole.backends.engine.deepspeed import fix_cuda_arch_list

    class Probe(CUDAOpBuilder):
        BUILD_VAR, NAME = "DS_BUILD_PROBE", "probe"

        def __init__(self):
            super().__init__(name=self.NAME)

        def absolute_name(self):
            return "probe"

        def sources(self):
            return []

    b = Probe()
    b.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError, match="0a"):
        b.compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", fix_cuda_arch_list("9.0a"))
    b.compute_capability_args()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0+PTX"


# ---------------------------------------------------------------------------------------------------
# Real runs

@pytest.mark.slow
def test_zero3_two_ranks_trains_and_ends_clean(zero3_tiny_run):
    """conftest's shared run: deepspeed.stage=3, train.steps=10, train.log_every=2."""
    run_dir, res = zero3_tiny_run.run, zero3_tiny_run.res
    msgs = assert_clean_run(res, run_dir)
    step_lines = [l for l in res.stdout.splitlines() if l.startswith("step ")]
    assert [l.split()[1] for l in step_lines] == ["2/10", "4/10", "6/10", "8/10", "10/10"]
    steps = of_kind(msgs, "step")
    assert [m.step for m in steps] == [2, 4, 6, 8, 10] and {m.rank for m in steps} == {0}
    assert steps[-1].loss < steps[0].loss - 0.5, [m.loss for m in steps]          # it learns
    assert all(m.loss_scale is None and m.skipped_steps == 0 and m.grad_norm for m in steps)
    mem = of_kind(msgs, "memory")
    assert {m.rank for m in mem} == {0, 1} and all(m.host_rss_bytes > 0 for m in mem)
    assert {(m.rank, m.step) for m in mem} >= {(0, 10), (1, 10)}
    phases = [e.detail for e in events(msgs, "phase")]
    # train.save_final is on by default: the trained weights are saved before the run ends.
    assert phases == ["starting", "building ops", "loading model", "training", "saving checkpoint", "finished"]
    assert [e.detail for e in events(msgs, "checkpoint_saved")] == [str(RunFolder(run_dir).checkpoints() /
                                                                       "step_00000010")]
    assert any("DeepSpeed ops ready" in e.detail for e in events(msgs, "info"))
    assert C.load(run_dir / PRESET_FILE).deepspeed.stage == 3


@pytest.mark.slow
def test_zero2_checkpoints_then_resume_continues(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = tmp_path / "first"
    res = run(first, "deepspeed.stage=2", "memory.activation_checkpointing=true", "train.steps=6",
              "train.log_every=1", "train.checkpoint_every=3", f"train.checkpoint_dir={ckpt}")
    msgs = assert_clean_run(res, first)
    losses = [m.loss for m in of_kind(msgs, "step")]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000003", "step_00000006"]    # no .partial left
    for step in (3, 6):
        d = ckpt / f"step_{step:08d}"
        # DeepSpeed's own layout, so its zero_to_fp32.py turns it into a full model.
        assert (d / "latest").read_text().strip() == f"global_step{step}"
        assert (d / "zero_to_fp32.py").is_file() and any((d / f"global_step{step}").glob("*optim_states.pt"))
    assert [e.detail for e in events(msgs, "checkpoint_saved")] == [str(ckpt / "step_00000003"),
                                                                   str(ckpt / "step_00000006")]

    second = tmp_path / "second"
    res = run(second, "deepspeed.stage=2", "train.steps=8", "train.log_every=1", "train.resume=true",
              f"train.checkpoint_dir={ckpt}")
    msgs = assert_clean_run(res, second)
    assert any("resumed from" in e.detail and "(step 6)" in e.detail for e in events(msgs, "info"))
    steps = of_kind(msgs, "step")
    assert [m.step for m in steps] == [7, 8]
    assert steps[0].loss < losses[0] - 0.3          # continues from trained weights, not from scratch


@pytest.mark.slow
def test_fp16_step_lines_carry_the_real_loss_scale_and_overflows(tmp_path):
    """A scale of 2**24 overflows fp16 gradients: DeepSpeed skips those steps and halves the scale
    (hysteresis 1); every skip is an `overflow` event and is counted in the step line."""
    run_dir = tmp_path / "run"
    res = run(run_dir, "precision.dtype=fp16", "precision.initial_scale_power=24", "precision.hysteresis=1",
              "train.steps=10", "train.log_every=1")
    msgs = assert_clean_run(res, run_dir)
    steps = of_kind(msgs, "step")
    assert len(steps) == 10 and all(isinstance(m.loss_scale, float) for m in steps)
    overflows = events(msgs, "overflow")
    assert 0 < len(overflows) < 10 and steps[-1].skipped_steps == len(overflows)
    by_step = {m.step: m for m in steps}
    scale = 2.0 ** 24
    for m in steps:
        skipped = any(e.step == m.step for e in overflows)
        assert m.loss_scale == (scale / 2 if skipped else scale), (m.step, m.loss_scale)
        scale = m.loss_scale
    assert by_step[10].loss < by_step[1].loss - 0.3, [m.loss for m in steps]
    assert "scale" in [l for l in res.stdout.splitlines() if l.startswith("step ")][-1]


@pytest.mark.slow
def test_fp16_overflow_at_the_minimum_scale_is_a_classified_failure(tmp_path):
    run_dir = tmp_path / "run"
    res = run(run_dir, "precision.dtype=fp16", "precision.initial_scale_power=24",
              f"precision.min_loss_scale={float(2 ** 24)}", "precision.hysteresis=1", "train.steps=4")
    assert res.returncode == EXIT_CODES["loss_scale_floor"], res.stdout + res.stderr
    msgs = messages(run_dir)
    failed = of_kind(msgs, "failed")
    assert failed and {f.cause for f in failed} == {"loss_scale_floor"}
    assert_nothing_left(run_dir, msgs)


@pytest.mark.slow
def test_optimizer_and_param_offload_to_cpu(tmp_path):
    """ZeRO-3 with optimizer and parameter offload: DeepSpeed's C++ CPUAdam, JIT-built on first use. A
    build that fails is this test failing (the offload presets depend on it), never a skip; the C++
    compiler is part of the test environment (README's set-up)."""
    assert shutil.which("c++") or shutil.which("g++"), "no C++ compiler: DeepSpeed's CPUAdam cannot be built"
    run_dir = tmp_path / "run"
    res = run(run_dir, "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu", "train.steps=10",
              "train.log_every=5")
    msgs = assert_clean_run(res, run_dir)
    assert any("CPUAdam" in e.detail for e in events(msgs, "info"))
    steps = of_kind(msgs, "step")
    assert steps[-1].loss < steps[0].loss - 0.5, [m.loss for m in steps]
    preset = C.load(run_dir / PRESET_FILE).deepspeed
    assert (preset.offload_optimizer, preset.offload_param) == ("cpu", "cpu")


@pytest.mark.slow
def test_deepspeed_launcher_runs_the_ranks(tmp_path):
    run_dir = tmp_path / "run"
    res = run(run_dir, "parallel.launcher=deepspeed", "train.steps=4", "train.log_every=2")
    msgs = assert_clean_run(res, run_dir)
    argv = json.loads((run_dir / "job.json").read_text())["argv"]
    assert "deepspeed.launcher.runner" in argv and any(a.startswith("--master_port=") for a in argv)
    assert [m.step for m in of_kind(msgs, "step")] == [2, 4]


@pytest.mark.slow
def test_local_model_folder_under_zero3_matches_fsdp(tmp_path):
    """A Hugging Face folder loaded into ZeRO-3 partitions (rank 0 reads one tensor at a time) gives the
    FSDP backend's first losses: same weights, same forward, same update. Its config names a pad token,
    as most released models' do (transformers' init of the padding row once crashed under zero.Init)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from shardconsole.settings.models import _COMMON, CATALOG
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-llama"
    LlamaForCausalLM(LlamaConfig(**{**_COMMON, **CATALOG["tiny"]}, pad_token_id=0)).save_pretrained(model_dir)
    common = [f"model.name={model_dir}", "precision.dtype=fp32", "train.steps=2", "train.log_every=1",
              "memory.activation_checkpointing=true"]
    ds_dir, fsdp_dir = tmp_path / "ds", tmp_path / "fsdp"
    assert_clean_run(run(ds_dir, "deepspeed.stage=3", *common), ds_dir)
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(fsdp_dir),
                       *[a for s in common for a in ("--set", s)], timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.stderr
    ds = [m.loss for m in of_kind(messages(ds_dir), "step")]
    fsdp = [m.loss for m in of_kind(messages(fsdp_dir), "step")]
    assert ds == pytest.approx(fsdp, abs=2e-4), (ds, fsdp)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_ctrl_c_mid_run_ends_every_rank(tmp_path, launcher):
    """Ctrl-C in the headless front end stops a ZeRO-3 run with optimizer offload (CPUAdam's threads)
    under either launcher: exit 130, nothing of the process group left."""
    import signal
    import subprocess
    import sys
    import time
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless",
                             "--run-dir", str(run_dir), "--set", "parallel.backend=deepspeed",
                             "--set", f"parallel.launcher={launcher}", "--set", "deepspeed.offload_optimizer=cpu",
                             "--set", "train.steps=100000", "--set", "train.log_every=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(run_dir, 1, RUN_TIMEOUT, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130, err[-3000:]
    assert took < 15, f"stop took {took:.1f}s"
    assert_nothing_left(run_dir, messages(run_dir))


@pytest.mark.slow
def test_one_seed_is_one_model_at_every_stage_and_in_fsdp(tmp_path):
    """Random init draws the same values whether the parameters are ZeRO-3 partitions, a full copy
    (ZeRO-2) or FSDP2 shards (on the device or offloaded), so in fp32 the runs give the same losses step
    for step; ZeRO-3 gathering each decoder layer whole (the default) and per Linear (DeepSpeed's own
    hooks) too."""
    common = ["precision.dtype=fp32", "train.steps=3", "train.log_every=1"]
    losses, norms = {}, {}
    for name, sets in (("zero2", ["deepspeed.stage=2"]), ("zero3", ["deepspeed.stage=3"]),
                       ("zero3-modules", ["deepspeed.stage=3", "deepspeed.stage3_layer_gather=false"])):
        d = tmp_path / name
        assert_clean_run(run(d, *sets, *common), d)
        losses[name] = [m.loss for m in of_kind(messages(d), "step")]
        norms[name] = [m.grad_norm for m in of_kind(messages(d), "step")]
    for name, sets in (("fsdp", []), ("fsdp-offload", ["fsdp.cpu_offload=true"])):
        d = tmp_path / name
        res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(d),
                           *[a for s in common + sets for a in ("--set", s)], timeout=RUN_TIMEOUT)
        assert res.returncode == 0, res.stderr
        losses[name] = [m.loss for m in of_kind(messages(d), "step")]
        norms[name] = [m.grad_norm for m in of_kind(messages(d), "step")]
    # Offloaded, FSDP2 sums the norm as each reduce-scatter lands (offload.DeviceGradNorm), not on the host.
    assert "summed where each reduce-scatter lands" in (tmp_path / "fsdp-offload" / "logs" / "rank0.log").read_text()
    assert losses["zero2"] == pytest.approx(losses["zero3"], abs=1e-4), losses
    assert losses["zero3-modules"] == pytest.approx(losses["zero3"], abs=1e-4), losses
    assert losses["zero3"] == pytest.approx(losses["fsdp"], abs=1e-4), losses
    # The gradient norm FSDP2 reports (backends/offload.grad_norm: local shards, summed over the mesh)
    # is DeepSpeed's, computed its own way.
    assert norms["fsdp"] == pytest.approx(norms["zero3"], rel=1e-4), norms
    assert losses["fsdp-offload"] == pytest.approx(losses["fsdp"], abs=1e-4), losses
    assert norms["fsdp-offload"] == pytest.approx(norms["zero3"], rel=1e-4), norms
