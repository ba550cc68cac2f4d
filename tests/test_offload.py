"""The offloaded step's pieces, on plain CPU tensors: the global norm over every core and the clip
folded into fused AdamW's grad_scale (the real 2-rank runs in test_runs.py cover the sharded path)."""

from __future__ import annotations

import torch

from shardconsole.backends import offload


def _params(seed: int, scale: float) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    ps = []
    for n in (3, 1000, 70_000, (1 << 21) + 17):      # the last spans three of the norm's chunks
        p = torch.nn.Parameter(torch.randn(n, generator=gen))
        p.grad = torch.randn(n, generator=gen) * scale
        ps.append(p)
    return ps


def test_host_sum_of_squares_matches_float64():
    grads = [p.grad for p in _params(0, 1.0)]
    want = sum(float(g.double().square().sum()) for g in grads)
    got = float(offload._host_sum_of_squares(grads))
    assert abs(got - want) / want < 1e-4


def test_folded_clip_is_the_same_update_as_clip_grad_norm():
    """The clip factor must reach the update: Adam's first moment holds (1 - beta1) * clipped gradient,
    so it differs from an unclipped step by the clip factor (10x here); params and moments match
    clip_grad_norm_ + step."""
    max_norm = 1.0
    ref, folded, unclipped = _params(1, 0.01), _params(1, 0.01), _params(1, 0.01)
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref]))
    assert norm > 10 * max_norm      # clipping is active
    opts = [torch.optim.AdamW(ps, lr=1e-2, fused=True) for ps in (ref, folded, unclipped)]
    torch.nn.utils.clip_grad_norm_(ref, max_norm)
    opts[0].step()
    got_norm = offload.fold_clip_into_step(folded, opts[1], max_norm, torch.device("cpu"))
    opts[1].step()
    opts[2].step()
    assert abs(float(got_norm) - norm) / norm < 1e-5
    for a, b, c in zip(ref, folded, unclipped):
        ma, mb, mc = (opts[i].state[p]["exp_avg"] for i, p in enumerate((a, b, c)))
        torch.testing.assert_close(mb, ma, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(b.data, a.data, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(mc, ma, rtol=0.5)
