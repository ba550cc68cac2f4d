"""The offloaded step's pieces: the global norm over every core and the clip folded into fused AdamW's
grad_scale on plain CPU tensors, and the norm summed at each reduce-scatter on a one-process FSDP2 model
(the real 2-rank runs in test_runs.py and test_deepspeed_run.py cover the sharded path); the host arena
(pinned_arena.py) on a one-process model and in a real 2-rank offloaded Kahan run resumed exactly, and a
Kahan resume from a checkpoint without compensation; a unit-at-a-time step (offload_overlap) against the whole step."""

from __future__ import annotations

import pytest
import torch

from shardconsole.backends.offload import host_copy as offload


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


def _offloaded_net(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    torch.manual_seed(seed)
    net = _Net()
    mesh = init_device_mesh("cpu", (1,))
    for layer in net.layers:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(net, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return net


def test_host_arena_holds_shards_and_states_and_trains_alike(tmp_path):
    """pinned_arena.ShardArena on a CPU rank (nothing pinned, the same layout): every shard and Adam state
    is a view of the one region, at aligned offsets, through forward, the step and a checkpoint-style
    reload of the optimizer state; the updates are those of the same model without the arena."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from shardconsole.backends.offload import pinned_arena
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain, packed = _offloaded_net(0), _offloaded_net(0)
        arena = pinned_arena.ShardArena(packed, pin=False, rounding="fp32", copy_dtype=None, grads_pinned=False)
        warned = []
        arena.watch(packed, warned.append)
        fps = offload.fsdp_params(packed)
        assert len(fps) == 8 and all(arena.arena.holds(fp._sharded_param_data) for fp in fps)
        assert all((fp._sharded_param_data.data_ptr() - arena.arena.buf.data_ptr()) % pinned_arena.ALIGN == 0
                   for fp in fps)
        for a, b in zip(plain.parameters(), packed.parameters()):
            assert torch.equal(a.to_local(), b.to_local())
            assert arena.arena.holds(b.to_local())
        opts = [torch.optim.AdamW(n.parameters(), lr=1e-2, fused=True) for n in (plain, packed)]
        assert arena.place_states(opts[1]) == 16             # exp_avg and exp_avg_sq of 8 parameters
        assert arena.check(opts[1]) == []
        for _ in range(3):
            x = torch.randn(4, 8)
            for net, opt in zip((plain, packed), opts):
                net(x).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert warned == [] and arena.check(opts[1]) == []
        for a, b in zip(plain.parameters(), packed.parameters()):
            torch.testing.assert_close(b.to_local(), a.to_local(), rtol=0, atol=0)
        # A reload that hands the optimizer new tensors (as a checkpoint from elsewhere does): back in place.
        sd = get_optimizer_state_dict(packed, opts[1])
        sd["state"] = {k: {n: (v.clone() if n != "step" else v) for n, v in s.items()} for k, s in sd["state"].items()}
        set_optimizer_state_dict(packed, opts[1], sd)
        assert arena.check(opts[1]) != []
        assert arena.place_states(opts[1]) == 16 and arena.check(opts[1]) == []
        for a, b in zip(opts[0].state.values(), opts[1].state.values()):
            torch.testing.assert_close(b["exp_avg"].to_local(), a["exp_avg"].to_local(), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_offloaded_kahan_run_keeps_its_state_in_the_arena_and_resumes_exactly(tmp_path):
    """A real 2-rank offloaded run (torchrun, gloo, CPU ranks) with bf16 masters and Kahan rounding: the
    shards and Adam's states with the compensation buffer live in the host arena; the checkpoint holds the
    compensation in bf16; resumed from step 3 the run repeats steps 4-6 exactly (the arena takes the
    loaded state, the rounding noise follows the checkpointed step). The first run steps each unit under
    the backward (fsdp.offload_overlap, no clip), the resumed one after it: the same rounding seeds a
    parameter, the same update."""
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    from tests.conftest import messages, of_kind, shardconsole
    ckpt = tmp_path / "ckpt"
    base = ["--preset", "tiny-cpu", "--headless", "--set", "precision.dtype=bf16",
            "--set", "precision.master_dtype=bf16", "--set", "precision.master_rounding=kahan",
            "--set", "fsdp.cpu_offload=true", "--set", "train.steps=6", "--set", "train.log_every=1",
            "--set", "train.save_final=false", "--set", f"train.checkpoint_dir={ckpt}",
            "--set", "train.clip_grad_norm=0"]
    first = tmp_path / "first"
    res = shardconsole(*base, "--run-dir", str(first), "--set", "train.checkpoint_every=3")
    assert res.returncode == 0, res.stderr[-2000:]
    log = (first / "logs" / "rank0.log").read_text()
    assert "host arena:" in log and "optimizer states" in log and "left the arena" not in log, log[-2000:]
    assert "host step starts when its gradients reach the host" in log
    meta = FileSystemReader(str(ckpt / "step_00000003")).read_metadata().state_dict_metadata
    comp = {k: v for k, v in meta.items() if k.startswith("optim.state.") and k.endswith("compensation")}
    assert comp and {str(v.properties.dtype) for v in comp.values()} == {"torch.bfloat16"}
    shutil.rmtree(ckpt / "step_00000006")
    second = tmp_path / "second"
    res = shardconsole(*base, "--run-dir", str(second), "--set", "train.resume=true",
                       "--set", "fsdp.offload_overlap=false")
    assert res.returncode == 0, res.stderr[-2000:]
    want = [(m.step, m.loss, m.grad_norm) for m in of_kind(messages(first), "step")][3:]
    got = [(m.step, m.loss, m.grad_norm) for m in of_kind(messages(second), "step")]
    assert [s for s, *_ in got] == [4, 5, 6]
    assert got == want


def test_kahan_resumes_from_a_checkpoint_written_without_compensation(tmp_path):
    """A checkpoint of a stochastic-rounding run, loaded by a kahan run (FSDP2, DCP, the product's reader and
    load planner): the moments come back, the compensation starts at zero; a checkpoint that lacks a
    moment still fails."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from shardconsole.backends.engine import fsdp_checkpoint
    from shardconsole.backends.optim.master_update import RoundedAdamW
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        nets, opts = [], []
        for rounding in ("stochastic", "kahan"):
            net = _offloaded_net(0)
            net.to(torch.bfloat16)
            opt = RoundedAdamW(net.parameters(), lr=1e-2, rounding=rounding)
            if rounding == "stochastic":          # the kahan run is a fresh one, as a resume starts
                net(torch.randn(4, 8, dtype=torch.bfloat16)).backward()
                opt.step()
            nets.append(net)
            opts.append(opt)
        dcp.save({"optim": get_optimizer_state_dict(nets[0], opts[0])}, checkpoint_id=str(tmp_path / "ck"))
        state = {"optim": get_optimizer_state_dict(nets[1], opts[1])}
        dcp.load(state, storage_reader=fsdp_checkpoint.SafeReader(str(tmp_path / "ck")),
                 planner=fsdp_checkpoint.safe_load_planner())
        set_optimizer_state_dict(nets[1], opts[1], state["optim"])
        for a, b in zip(opts[0].state.values(), opts[1].state.values()):
            assert torch.equal(b["exp_avg"].to_local(), a["exp_avg"].to_local())
            assert not b["compensation"].to_local().any()
        # the reverse lacks nothing the stochastic run needs; a missing moment is still an error
        broken = {"optim": get_optimizer_state_dict(nets[1], opts[1])}
        dcp.save({"optim": {"state": {k: {n: t for n, t in s.items() if n != "exp_avg_sq"}
                                      for k, s in broken["optim"]["state"].items()},
                            "param_groups": broken["optim"]["param_groups"]}}, checkpoint_id=str(tmp_path / "ck2"))
        state = {"optim": get_optimizer_state_dict(nets[1], opts[1])}
        with pytest.raises(BaseException, match="exp_avg_sq|Missing key"):
            dcp.load(state, storage_reader=fsdp_checkpoint.SafeReader(str(tmp_path / "ck2")),
                     planner=fsdp_checkpoint.safe_load_planner())
    finally:
        dist.destroy_process_group()


def test_nvme_offload_without_the_async_io_op_is_one_line(tmp_path):
    """deepspeed.offload_optimizer = "nvme" on a machine where DeepSpeed's async I/O op cannot be built
    (no libaio, as on the CI machine): refused before launch (session/preflight.check_nvme_offload) with one
    line naming the setting, no rank started; where it can be built, the 2-rank run trains with its
    optimizer states on the given folder."""
    import os

    from deepspeed.ops.op_builder import AsyncIOBuilder

    from tests.conftest import messages, of_kind, shardconsole
    run_dir, nvme = tmp_path / "run", tmp_path / "nvme"
    nvme.mkdir()
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
                       "--set", "parallel.backend=deepspeed", "--set", "deepspeed.stage=3",
                       "--set", "deepspeed.offload_optimizer=nvme", "--set", f"deepspeed.nvme_path={nvme}",
                       "--set", "train.steps=2", env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=240)
    if AsyncIOBuilder().is_compatible(verbose=False):
        assert res.returncode == 0, res.stderr[-2000:]
        assert [m.step for m in of_kind(messages(run_dir), "step")] == [1, 2]
        assert any(nvme.rglob("*"))
    else:
        assert res.returncode == 2, res.stderr[-2000:]
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "deepspeed.offload_optimizer" in lines[0] and "async I/O op" in lines[0], res.stderr
        assert not (run_dir / "logs").exists()          # no rank started


def test_a_unit_at_a_time_is_the_whole_step_and_overlap_is_off_where_the_step_needs_every_gradient():
    """offload_overlap steps the run's optimizer narrowed to one FSDP unit's parameters at a time
    (partial_step.PartialStep, which step_in_backward shares): for torch's fused AdamW and RoundedAdamW
    (stochastic rounding seeded by each parameter's place in the whole optimizer), over two param groups
    and a unit that spans both, the result is bit for bit the whole step's, and the groups are whole
    again after each partial step. And it is off where an update needs every gradient first: a clip
    (the presets' default) or fp16 loss scaling, each said with the key to change."""
    from types import SimpleNamespace

    from shardconsole.backends.offload import overlap as offload_overlap
    from shardconsole.backends.optim import partial_step
    from shardconsole.backends.optim.master_update import RoundedAdamW
    from shardconsole.settings import resolve
    for make, dtype in ((lambda gs: torch.optim.AdamW(gs, lr=1e-2, fused=True), torch.float32),
                        (lambda gs: RoundedAdamW(gs, lr=1e-2, rounding="stochastic", seed=7), torch.bfloat16)):
        whole, parts = _params(3, 1.0), _params(3, 1.0)
        for p in (*whole, *parts):
            p.data, p.grad = p.data.to(dtype), p.grad.to(dtype)
        opts = [make([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]) for ps in (whole, parts)]
        partial = partial_step.PartialStep(opts[1])
        every = [[id(p) for p in g["params"]] for g in opts[1].param_groups]
        for _ in range(2):
            opts[0].step()
            for unit in (parts[3:], parts[1:3], parts[:1]):        # the units in backward order
                partial.step(unit)
                assert [[id(p) for p in g["params"]] for g in opts[1].param_groups] == every
        for a, b in zip(whole, parts):
            assert torch.equal(a.data, b.data)
            assert torch.equal(opts[0].state[a]["exp_avg_sq"], opts[1].state[b]["exp_avg_sq"])
            assert int(opts[1].state[b]["step"]) == 2         # each parameter stepped once a step

    def reason(*sets, scaler=None):
        r = SimpleNamespace(cfg=resolve.resolve("tiny-cpu", ["fsdp.cpu_offload=true", *sets]).cfg)
        return offload_overlap.why_not(r, torch.optim.AdamW(_params(0, 1.0), fused=True), scaler)
    assert reason("train.clip_grad_norm=0") == ""
    assert "train.clip_grad_norm = 1 needs the global gradient norm" in reason()
    assert "fp16 loss scaling" in reason("train.clip_grad_norm=0", scaler=object())
    assert reason("train.clip_grad_norm=0", "fsdp.offload_overlap=false") == "off"


def test_the_host_step_thread_and_its_openmp_workers_yield_to_the_launching_thread():
    """offload_overlap's host thread starts at nice HOST_NICE on every core by default, and the OpenMP
    workers its first parallel kernel starts inherit that (Linux: nice is a thread's); a rank already
    niced further stays as it is (raising a priority back is not ours to do). Read from /proc."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from shardconsole.backends.offload import overlap as offload_overlap

    def nices() -> dict[int, int]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                stat = open(f"/proc/self/task/{tid}/stat").read()
            except FileNotFoundError:     # a thread that ended between the listing and the read
                continue
            out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
        return out

    def work(first_nice: int) -> tuple[int, dict[int, int]]:
        x = torch.randn(512, 512)
        for _ in range(3):
            x = torch.tanh(x @ x)            # a parallel kernel: the thread's OpenMP team starts
        return threading.get_native_id(), nices()

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())      # pytest's own (0 unless niced)
    want = max(mine, 10)
    from shardconsole.backends.rank.knobs import Knobs
    plan, cores, _, nice = offload_overlap._host_threads(Knobs.from_env({}))
    assert plan == [torch.get_num_threads()] and cores is None and nice == 10
    before = set(nices())
    with ThreadPoolExecutor(1, initializer=offload_overlap._start_host_thread,
                            initargs=(2, None, nice)) as pool:
        tid, seen = pool.submit(work, 0).result()
    started = {t: n for t, n in seen.items() if t not in before}
    assert started[tid] == want and set(started.values()) == {want}, started   # the thread and its workers
    assert nices()[threading.get_native_id()] == mine                          # the launching thread is not

    def already_niced():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(mine, 15))
        offload_overlap._start_host_thread(1, None, 10)
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(already_niced).result() == max(mine, 15)


def test_the_gradients_in_flight_are_held_to_the_bound():
    """fsdp.offload_grads_in_flight: the backward's hook waits for the oldest unfinished host steps until
    bound - 1 are left, so at most `bound` units' gradients are on the host with the landing one; 0 is no
    bound. Host steps held open by events (the host thread is one thread, steps run in order)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from shardconsole.backends.offload.overlap import InFlight

    pool = ThreadPoolExecutor(1)
    gates = [threading.Event() for _ in range(5)]
    futures = [pool.submit(g.wait) for g in gates]
    for bound, want_waits in ((0, 0), (6, 0)):      # no bound, or one above what is pending: never waits
        free = InFlight(bound)
        free.admit(futures)
        assert (free.waits, free.most) == (want_waits, 6)
    held = InFlight(3)
    admitted = threading.Event()

    def admit() -> None:
        held.admit(futures)
        admitted.set()

    t = threading.Thread(target=admit, daemon=True)
    t.start()
    try:
        for i, g in enumerate(gates[:3]):
            assert not admitted.is_set(), f"admitted with {5 - i} steps unfinished (bound 3: 2 may be left)"
            g.set()
            futures[i].result()
        t.join(timeout=60)
        assert admitted.is_set() and (held.waits, held.most) == (1, 3)
    finally:
        for g in gates:
            g.set()
        pool.shutdown(wait=True)


def test_a_bounded_overlap_is_the_same_run(tmp_path):
    """A real 2-rank offloaded run with the gradients in flight held to one unit (the backward waits for
    every host step) trains exactly as with no bound; the rank log says the most it saw."""
    from tests.conftest import messages, of_kind, shardconsole
    base = ["--preset", "tiny-cpu", "--headless", "--set", "fsdp.cpu_offload=true", "--set", "train.steps=3",
            "--set", "train.log_every=1", "--set", "train.save_final=false", "--set", "train.clip_grad_norm=0"]
    runs = {}
    for bound in (1, 0):
        run = tmp_path / f"b{bound}"
        res = shardconsole(*base, "--run-dir", str(run), "--set", f"fsdp.offload_grads_in_flight={bound}")
        assert res.returncode == 0, res.stderr[-2000:]
        runs[bound] = [(m.step, m.loss, m.grad_norm) for m in of_kind(messages(run), "step")]
    log = (tmp_path / "b1" / "logs" / "rank0.log").read_text()
    assert "at most 1 units' gradients on the host at once (fsdp.offload_grads_in_flight = 1" in log, log[-2000:]
    assert len(runs[1]) == 3 and runs[1] == runs[0]
