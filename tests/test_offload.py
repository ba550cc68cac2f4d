"""The offloaded step's pieces: the global norm over every core and the clip folded into fused AdamW's
grad_scale on plain CPU tensors, and the norm summed at each reduce-scatter on a one-process FSDP2 model
(the real 2-rank runs in test_runs.py and test_deepspeed_run.py cover the sharded path)."""

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


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().sum()


def test_norm_summed_at_each_reduce_scatter_is_the_host_gradients_norm(tmp_path):
    """DeviceGradNorm reads each unit's reduced gradient in FSDP2's all-reduce hook (one process, gloo,
    offloaded to the host as a run does); it must give the norm of the gradients the step then reads,
    and None (so the caller reads the host gradients) when a unit did not report."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = _Net()
        mesh = init_device_mesh("cpu", (1,))
        for layer in net.layers:
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(net, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        assert offload.DeviceGradNorm.applies(net, None)
        norm = offload.DeviceGradNorm(net, torch.device("cpu"))
        for _ in range(2):     # the sum restarts each step
            net(torch.randn(4, 8)).backward()
            got = norm.take()
            want = offload.grad_norm(list(net.parameters()), torch.device("cpu"))
            assert float(want) > 0
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
            net.zero_grad(set_to_none=True)
        net.layers[2].set_requires_gradient_sync(False)   # that unit does not reduce: no norm from the hook
        net(torch.randn(4, 8)).backward()
        assert norm.take() is None
    finally:
        dist.destroy_process_group()
