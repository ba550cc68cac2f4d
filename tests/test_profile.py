"""SHARDCONSOLE_PROFILE=A-B: torch's profiler over steps A..B of a real 2-rank run, the kernels' table and the
timeline in the run folder, and one line in each rank's log saying where the time went by kind."""

from __future__ import annotations

import json
import re

import pytest

from shardconsole.backends.observe.profile import by_kind, kind_of
from shardconsole.backends.rank.knobs import Knobs, KnobError
from tests.conftest import shardconsole


# Kernel names as an H200 run's profile prints them (torch 2.11, 1b compiled, FSDP2), and CPU operators.
@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off", "matmul"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "matmul"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>", "attention"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("Memcpy HtoD (Pinned -> Device)", "copies"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>", "copies"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "elementwise"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16>", "other"),
    ("aten::mm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("FSDP::all_gather (lm.model.layers.0)", "communication"),
])
def test_kinds_by_name(name, kind):
    assert kind_of(name) == kind


def test_by_kind_sums_and_orders():
    kinds = by_kind({"aten::mm": 3.0, "aten::addmm": 1.0, "flash_fwd": 2.0, "triton_poi_fused_silu": 0.5,
                     "indexSelectLargeIndex": 0.25})
    assert kinds == {"matmul": 4.0, "attention": 2.0, "elementwise": 0.5, "other": 0.25}
    assert list(kinds) == ["matmul", "attention", "elementwise", "other"]


@pytest.mark.parametrize("raw, span", [("", None), ("20-22", (20, 22)), ("7", (7, 7)), (" 3-3 ", (3, 3))])
def test_knob_reads_a_span(raw, span):
    assert Knobs.from_env({"SHARDCONSOLE_PROFILE": raw}).profile_steps == span


@pytest.mark.parametrize("raw", ["3-1", "0-2", "a-b", "2-", "-3"])
def test_knob_refuses_what_is_no_span(raw):
    with pytest.raises(KnobError, match="SHARDCONSOLE_PROFILE"):
        Knobs.from_env({"SHARDCONSOLE_PROFILE": raw})


def test_a_run_profiles_its_steps_and_says_where_the_time_went(tmp_path):
    """Steps 4..99 of a 6-step run: the profile ends with the run's last step; both ranks write theirs."""
    run = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=6",
                       "--set", "train.save_final=false", env={"SHARDCONSOLE_PROFILE": "4-99"}, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in (0, 1):
        table = (run / "profile" / f"rank{rank}.txt").read_text()
        assert "aten::mm" in table
        trace = json.loads((run / "profile" / f"rank{rank}.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::mm" in names
        log = (run / "logs" / f"rank{rank}.log").read_text()
        lines = [ln for ln in log.splitlines() if "profile steps" in ln]
        assert len(lines) == 1, log[-2000:]
        assert f"profile steps 4-6 (rank {rank}, cpu)" in lines[0]
        shares = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)%", lines[0].split(": ", 2)[-1])}
        assert {"matmul", "communication", "attention"} <= set(shares), lines[0]
        assert 97 <= sum(shares.values()) <= 103, lines[0]
    # nothing half-written left beside the files (the table is written atomically through a hidden temporary)
    assert sorted(p.name for p in (run / "profile").iterdir()) == [
        "rank0.trace.json", "rank0.txt", "rank1.trace.json", "rank1.txt"]


def test_a_resumed_run_profiles_from_where_it_resumed(tmp_path):
    """A resume past A (a checkpoint at step 3, resumed to 6, SHARDCONSOLE_PROFILE=2-5) profiles steps 4-5."""
    run = tmp_path / "run"
    first = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=3",
                         timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert not (run / "profile").exists()
    res = shardconsole("resume", str(run), "--set", "train.steps=6",
                       env={"SHARDCONSOLE_PROFILE": "2-5"}, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (run / "logs" / "rank0.log").read_text()
    assert "profile steps 4-5 (rank 0, cpu)" in log, log[-2000:]
    assert (run / "profile" / "rank0.txt").exists()
