"""Issue 45: the step line's figures are per optimizer step. With train.grad_accum = k an optimizer step is k
micro-batches; a meter that counted micro-batches printed step_s / k and tokens/s, samples/s and MFU x k.
A second clock checks the first: the step lines' own wall times (each message's `t`)."""

from __future__ import annotations

import pytest

from tests.conftest import messages, of_kind, shardconsole

ACCUM, MICRO, SEQ, WORLD = 4, 1, 64, 2


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_step_lines_match_the_wall_clock_with_grad_accum(tmp_path, backend):
    run = tmp_path / "run"
    sets = ["train.steps=8", "train.log_every=1", f"train.grad_accum={ACCUM}", f"train.micro_batch={MICRO}",
            f"data.seq_len={SEQ}", f"parallel.nproc_per_node={WORLD}", "train.save_final=none"]
    if backend == "deepspeed":
        sets += ["parallel.backend=deepspeed", "deepspeed.stage=2"]
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *[a for s in sets for a in ("--set", s)], timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = of_kind(messages(run), "step")
    assert [s.step for s in steps] == list(range(1, 9))
    per_step = MICRO * ACCUM * SEQ * WORLD            # tokens one optimizer step consumes, all ranks
    assert [s.tokens for s in steps] == [per_step * s.step for s in steps]
    for s in steps:
        assert s.tokens_per_s * s.step_s == pytest.approx(per_step, rel=1e-6)
        assert s.samples_per_s * s.step_s == pytest.approx(MICRO * ACCUM * WORLD, rel=1e-6)
    # Lines 3..8 against the wall clock between lines 2 and 8: each step time is measured inside its interval
    # (so the sum cannot exceed it), and only the line's own reduction and write fall outside. A meter that
    # counts micro-batches prints a quarter of it.
    wall = steps[-1].t - steps[1].t
    printed = sum(s.step_s for s in steps[2:])
    assert printed <= wall * 1.01
    assert printed > 0.6 * wall, (printed, wall)
