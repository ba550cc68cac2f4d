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


class _SlowAdamW(torch.optim.AdamW):
    """Steps late, so that a forward that did not wait for its layer's update would see the old one."""

    def step(self, closure=None):
        import time
        time.sleep(0.05)
        return super().step(closure)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def test_overlapped_step_makes_each_layer_wait_for_its_own_update():
    """Every layer's forward must see its parameters already stepped, the root's before the first layer;
    a layer may run before later layers are stepped (that is the overlap)."""
    net = _Net()
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    optim = _SlowAdamW(net.parameters(), lr=0.1)
    overlap = offload.OverlappedStep(net, list(net.layers), forward_prefetch=1)
    seen: list[list[int]] = []
    for layer in net.layers:
        layer.register_forward_pre_hook(
            lambda m, a: seen.append([int(optim.state[p]["step"]) if p in optim.state else 0 for p in m.parameters()]))
    before = [p.detach().clone() for p in net.layers[0].parameters()]
    overlap.launch(optim)
    net(torch.ones(1, 4))
    assert seen == [[1, 1]] * 4
    assert not any(torch.equal(a, b) for a, b in zip(before, net.layers[0].parameters()))
    overlap.wait_all()
    assert all(p.grad is None for p in net.parameters())       # zero_grad, unit by unit
    assert all(int(optim.state[p]["step"]) == 1 for p in net.parameters())


def test_a_failed_step_in_the_thread_fails_the_next_forward():
    net = _Net()
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    optim = torch.optim.AdamW(net.parameters(), lr=0.1)
    optim.param_groups[0]["lr"] = "not a number"      # the step raises inside the thread
    overlap = offload.OverlappedStep(net, list(net.layers), forward_prefetch=1)
    overlap.launch(optim)
    import pytest
    with pytest.raises(TypeError):
        net(torch.ones(1, 4))
