"""GPU truth (issue 19): ranks on the right card by UUID, the GPU panel's NVML vitals, the offload view on a
real offloaded run, and a hang report that names the collective each rank is in.

There is no GPU here: the UUID mapping is tested against a small stand-in for the pynvml calls (the one
place a fake is allowed: a mixed rig cannot be had on this machine). Everything else is a real run."""

from __future__ import annotations

import json

import pytest

from shardconsole.machine import flight_recorder, offload_verdict
from shardconsole.runlog import protocol as P
from shardconsole.console.runview import RunView
from shardconsole.console.widgets.run_panels import gpu_vitals, offload_view
from shardconsole.machine.probes import GpuProbe, wait_gpu_released
from shardconsole.session.outcome import EXIT_CODES
from tests.conftest import assert_nothing_left, messages, of_kind, shardconsole

# A consumer rig: NVML numbers cards by PCI bus id, so the display card (bus 01) is NVML 0; CUDA numbers
# fastest first, so the two 4090s are CUDA 0 and 1 and the display card CUDA 2.
CARDS = [
    {"uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000001", "name": "NVIDIA GeForce GT 1030", "bus": "00000000:01:00.0"},
    {"uuid": "GPU-bbbbbbbb-0000-0000-0000-000000000002", "name": "NVIDIA GeForce RTX 4090", "bus": "00000000:02:00.0"},
    {"uuid": "GPU-cccccccc-0000-0000-0000-000000000003", "name": "NVIDIA GeForce RTX 4090", "bus": "00000000:03:00.0"},
]


class FakeNvml:
    """The pynvml calls probes.py makes, answering for CARDS (a handle is the NVML index)."""
    NVML_TEMPERATURE_GPU, NVML_CLOCK_SM = 0, 1
    NVML_PCIE_UTIL_RX_BYTES, NVML_PCIE_UTIL_TX_BYTES = 1, 0

    class _Mem:
        def __init__(self, used, total):
            self.used, self.total = used, total

    class _Util:
        gpu = 97

    class _Proc:
        def __init__(self, pid):
            self.pid = pid

    class _Pci:
        def __init__(self, bus):
            self.busId = bus

    def __init__(self, pids=None):
        self.pids = pids or {}

    def nvmlInit(self): pass
    def nvmlDeviceGetCount(self): return len(CARDS)
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetUUID(self, h): return CARDS[h]["uuid"].encode()      # older bindings return bytes
    def nvmlDeviceGetName(self, h): return CARDS[h]["name"]
    def nvmlDeviceGetPciInfo(self, h): return self._Pci(CARDS[h]["bus"])
    def nvmlDeviceGetCurrPcieLinkGeneration(self, h): return 4
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h): return 4
    def nvmlDeviceGetCurrPcieLinkWidth(self, h): return 16 if h else 4
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): return 16
    def nvmlDeviceGetMemoryInfo(self, h): return self._Mem((h + 1) * 2**30, 24 * 2**30)
    def nvmlDeviceGetUtilizationRates(self, h): return self._Util()
    def nvmlDeviceGetComputeRunningProcesses(self, h): return [self._Proc(p) for p in self.pids.get(h, ())]
    def nvmlDeviceGetTemperature(self, h, sensor): return 60 + h
    def nvmlDeviceGetEnforcedPowerLimit(self, h): return 450_000                  # milliwatts
    def nvmlDeviceGetClockInfo(self, h, clock): return 2520
    def nvmlDeviceGetMaxClockInfo(self, h, clock): return 3105
    def nvmlDeviceGetCurrentClocksEventReasons(self, h): return 0x4 | 0x1 if h == 2 else 0x1  # power cap + idle
    def nvmlDeviceGetPcieThroughput(self, h, counter): return 12_000_000 if counter == 1 else 3_000_000  # KB/s

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 0:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")     # display cards often cannot say
        return 431_500


def _torch_uuid(i: int) -> str:
    return CARDS[i]["uuid"][4:]     # torch's device properties: no "GPU-" prefix


def test_ranks_are_placed_on_their_card_by_uuid_not_by_index():
    # CUDA_VISIBLE_DEVICES as CUDA indices without CUDA_DEVICE_ORDER=PCI_BUS_ID: the probe cannot tell which
    # NVML cards those are, so it samples every card and the ranks' UUIDs place them.
    probe = GpuProbe(nvml=FakeNvml(), environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    samples = probe.sample("r")
    assert [s.index for s in samples] == [0, 1, 2]
    view = RunView(local_host="box")
    for rank, card in ((0, 1), (1, 2)):          # CUDA 0 = NVML 1, CUDA 1 = NVML 2
        view.apply(P.Hello(rank=rank, world=2, host="box", pid=100 + rank, device=f"cuda:{rank}",
                           gpu_uuid=_torch_uuid(card)))
        view.apply(P.Memory(rank=rank, step=1, reserved_bytes=2**30, device_index=rank))
    for s in samples:
        view.apply(s)
    on_gpu, elsewhere = view.ranks_by_gpu()
    assert on_gpu == {1: [0], 2: [1]} and elsewhere == []     # by index it was {0: [0], 1: [1]}
    assert view.state.gpu_of(1).name == "NVIDIA GeForce RTX 4090" and view.state.gpu_of(1).index == 2

    # UUIDs (and unique prefixes, as CUDA takes them) in CUDA_VISIBLE_DEVICES select exactly those cards,
    # in that order; integers under PCI_BUS_ID are NVML's own order.
    assert [c.index for c in GpuProbe(nvml=FakeNvml(), environ={
        "CUDA_VISIBLE_DEVICES": "GPU-cccccccc,GPU-bbbbbbbb-0000-0000-0000-000000000002"}).cards] == [2, 1]
    assert [c.index for c in GpuProbe(nvml=FakeNvml(), environ={
        "CUDA_VISIBLE_DEVICES": "1,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}).cards] == [1, 2]


def test_gpu_sample_carries_the_vitals_the_panel_shows():
    samples = {s.index: s for s in GpuProbe(nvml=FakeNvml(), environ={}).sample()}
    hot = samples[2]
    assert hot.uuid == CARDS[2]["uuid"] and hot.temp_c == 62.0
    assert hot.power_w == 431.5 and hot.power_limit_w == 450.0              # from milliwatts
    assert hot.sm_clock_mhz == 2520.0 and hot.sm_clock_max_mhz == 3105.0
    assert hot.throttle == ("sw_power_cap",)                                 # idle is not a slowdown
    assert hot.pcie_rx_bps == 12_000_000 * 1024 and hot.pcie_tx_bps == 3_000_000 * 1024   # from KB/s
    assert samples[0].power_w is None and samples[0].throttle == ()          # what a card cannot say: None
    assert P.decode(P.encode(hot)) == hot                                     # the stream carries it whole
    assert gpu_vitals(hot) == "62°C · 432/450 W · SM 2520/3105 MHz · PCIe ↓12.3 ↑3.1 GB/s · throttled: sw_power_cap"
    assert gpu_vitals(samples[0]).startswith("60°C · SM 2520/3105 MHz")


def test_release_check_names_the_runs_cards_by_uuid_and_rank():
    nv = FakeNvml(pids={2: (4242,)})
    probe = GpuProbe(nvml=nv, environ={})
    held = wait_gpu_released(probe, [4242], timeout_s=0.3, rank_uuids={0: _torch_uuid(1), 1: _torch_uuid(2)})
    assert held.startswith("GPU memory NOT released: GPU2 (GPU-cccccccc) rank 1 still held by pid(s) [4242]")
    assert "GPU0" not in held                   # the display card is not the run's
    nv.pids = {}
    assert wait_gpu_released(probe, [4242], rank_uuids={0: _torch_uuid(1), 1: _torch_uuid(2)}) == (
        "GPU memory released: no process of the run on any GPU (GPU1 (GPU-bbbbbbbb) rank 0 2.0/24 GiB used, "
        "GPU2 (GPU-cccccccc) rank 1 3.0/24 GiB used)")


@pytest.mark.parametrize("times, knobs, verdict, words", [
    ((0.40, 0.90, 0.10, 0.05), offload_verdict.Knobs(), offload_verdict.HOST, "train.grad_accum"),
    ((0.40, 0.90, 0.10, 0.05), offload_verdict.Knobs(clip_blocks_overlap=True), offload_verdict.HOST,
     "train.clip_grad_norm = 0"),
    ((0.50, 0.20, 0.45, 0.10), offload_verdict.Knobs(backend="fsdp", compute_copy=False),
     offload_verdict.PCIE, "fsdp.offload_compute_copy = true"),
    ((0.50, 0.20, 0.45, 0.10), offload_verdict.Knobs(backend="fsdp", compute_copy=True),
     offload_verdict.PCIE, "train.micro_batch"),
    ((0.50, 0.20, 0.45, None), offload_verdict.Knobs(backend="deepspeed", offload_param=True),
     offload_verdict.PCIE, 'deepspeed.offload_param = "none"'),
    ((0.50, 0.20, 0.45, 0.1), offload_verdict.Knobs(pin_memory=False), offload_verdict.PCIE, "fsdp.pin_memory = true"),
    ((0.80, 0.20, 0.30, 0.20), offload_verdict.Knobs(checkpointing=True), offload_verdict.GPU,
     "memory.activation_checkpointing = false"),
])
def test_offload_verdict_names_the_bottleneck_and_the_setting(times, knobs, verdict, words):
    v, hint = offload_verdict.verdict(*times, knobs)
    assert v == verdict and words in hint


def test_offload_line_reads_pcie_from_the_ranks_copies_before_nvml():
    # 3.5 GB in and 3.0 GB out in a 0.5 s step: 7.0 and 6.0 GB/s, whatever NVML's 20 ms window caught.
    assert offload_verdict.pcie_rates(3_500_000_000, 3_000_000_000, 0.5, 0.0, 0.0) == (7.0, 6.0, "step average")
    assert offload_verdict.pcie_rates(0, 0, 0.5, 12e9, 3e9) == (12.0, 3.0, "NVML")     # copies not counted
    assert offload_verdict.pcie_rates(0, 0, 0.5) is None                             # nothing to say
    text = offload_verdict.line(offload_verdict.PCIE, "train.micro_batch", 0.2, 0.1, 0.3, 0.1, 0.5,
                                offload_verdict.pcie_rates(3_500_000_000, 3_000_000_000, 0.5), 6 * 2**30)
    assert "PCIe ↓7.0 ↑6.0 GB/s (step average) · pinned 6.0 GiB · try train.micro_batch" in text


OFFLOAD_RUN = ["--preset", "tiny-cpu", "--headless", "--set", "fsdp.cpu_offload=true", "--set", "train.steps=6",
               "--set", "train.log_every=3", "--set", "train.clip_grad_norm=0"]


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory):
    """One real 2-rank FSDP2 run with CPU offload (on CPU ranks: the wall-clock offload view), fp32, no clip:
    the host step overlaps the backward (fsdp.offload_overlap, on by default)."""
    run_dir = tmp_path_factory.mktemp("offload") / "run"
    res = shardconsole(*OFFLOAD_RUN, "--run-dir", str(run_dir),
                       env={"SHARDCONSOLE_P2P_NOTE": "NCCL_P2P_DISABLE=1 set for this run: test"}, timeout=240)
    return res, run_dir, messages(run_dir)


def test_overlapped_host_step_gives_the_plain_steps_losses(offload_run, tmp_path):
    """fsdp.offload_overlap: each unit stepped as its gradients land, on a host thread, during the backward
    of the units before it, is the same update as the plain step after the backward (fp32, 2 ranks)."""
    res, run_dir, msgs = offload_run
    assert res.returncode == 0, res.stderr
    assert "host step starts when its gradients reach the host" in (run_dir / "logs" / "rank0.log").read_text()
    plain = tmp_path / "plain"
    res = shardconsole(*OFFLOAD_RUN, "--run-dir", str(plain), "--set", "fsdp.offload_overlap=false", timeout=240)
    assert res.returncode == 0, res.stderr
    assert {m.overlap for m in of_kind(messages(plain), "offload")} == {"off (fsdp.offload_overlap = false)"}
    want = [m.loss for m in of_kind(messages(plain), "step")]
    got = [m.loss for m in of_kind(msgs, "step")]
    assert len(got) == 2 and got[1] < got[0]       # the means of steps 1-3 and 4-6 (log_every = 3)
    assert got == pytest.approx(want, rel=1e-5, abs=0)


def test_offload_view_on_a_real_offloaded_run(offload_run):
    res, run_dir, msgs = offload_run
    assert res.returncode == 0, res.stderr
    lines = of_kind(msgs, "offload")
    assert sorted((m.rank, m.step) for m in lines) == [(0, 3), (0, 6), (1, 3), (1, 6)]   # each rank, log steps
    steps = {m.step: m for m in of_kind(msgs, "step")}
    for m in lines:
        assert m.clock == "wall_clock" and m.steps == 3
        assert m.gpu_s > 0 and m.host_step_s > 0
        # the host step's seconds that ran under the backward, not paid again by the step
        assert m.overlap == "on" and 0 <= m.host_hidden_s <= m.host_step_s
        assert m.gpu_s + m.host_step_s - m.host_hidden_s <= m.step_s * 1.001          # phases inside the step
        if m.rank == 0:
            # the view's steps lie inside the step line's interval (rank 0's, the same perf_counter): an
            # order, not a ratio; a loaded box stretches the interval's data and report parts, not the step
            assert m.step_s <= steps[m.step].step_s * 1.001
        assert m.h2d_s is None and m.d2h_s is None                  # CPU ranks copy nothing
        assert m.verdict == offload_verdict.COMPUTE
        assert m.view_s > 0
    # the view's own cost: under 1% of a step (the median line: one preempted call on a loaded box is not it)
    assert sorted(m.view_s / m.step_s for m in lines)[len(lines) // 2] < 0.01
    out = res.stdout.splitlines()
    assert sum(line.startswith("offload: compute bound · GPU ") and " · overlap on: host step " in line
               for line in out) == 2, res.stdout
    assert "offload verdict (mean of steps to 6): compute bound" in res.stderr
    # the launch's P2P note (set by launch_command when the doctor's verdict says so) is said by rank 0
    assert [e.detail for e in of_kind(msgs, "event") if e.name == "info" and "NCCL_P2P_DISABLE" in e.detail] == [
        "NCCL_P2P_DISABLE=1 set for this run: test"]
    view = RunView()
    for m in msgs:
        view.apply(m)
    rows = [text for text, _ in offload_view(view)]
    assert rows[0] == "offload · rank 0, mean of 3 step(s) to 6 (wall clock: CPU ranks)" or \
        rows[0] == "offload · rank 1, mean of 3 step(s) to 6 (wall clock: CPU ranks)"
    assert rows[-2].startswith("  overlap on: host step ") and rows[-1] == "  compute bound"


def test_hang_report_names_the_collective_each_rank_is_in(tmp_path):
    run_dir = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir), "--set", "train.steps=1000",
                       "--set", "train.hang_timeout_s=6", "--set", "train.log_every=1",
                       "--set", "train.save_on_stop=false",     # nothing to save: the stop ends it at once
                       env={"SHARDCONSOLE_FAULT": "sleep@rank=1,step=3"}, timeout=240)
    msgs = messages(run_dir)
    assert_nothing_left(run_dir, msgs)
    assert res.returncode == EXIT_CODES["hang"], res.stderr
    line = next(x for x in res.stderr.splitlines() if x.startswith("run hung"))
    # rank 0 sits in the gloo collective of step 3 that rank 1 (asleep in Python) never entered
    assert "collectives: rank 0 in gloo:" in line, line
    assert "rank 1 not in a collective (last finished in that group: gloo:" in line
    assert "rank(s) 1 never entered collective #" in line
    dumps = {r: flight_recorder.read(run_dir / "logs", r, 0) for r in (0, 1)}
    waiting = [e for e in dumps[0] if not e.get("retired")]
    assert waiting and waiting[0]["profiling_name"] in line and f"#{waiting[0]['collective_seq_id']} " in line
    assert max(e["collective_seq_id"] for e in dumps[1] if e["process_group"] == waiting[0]["process_group"]) \
        < waiting[0]["collective_seq_id"]


def test_flight_recorder_summary_of_nccl_states():
    """NCCL's watchdog marks entries started/completed (gloo only retires them); a second process group's
    sequence numbers are its own."""
    def e(seq, state, pg="0", name="nccl:all_reduce"):
        return {"collective_seq_id": seq, "state": state, "process_group": [pg, "default_pg" if pg == "0" else "sub"],
                "profiling_name": name, "input_sizes": [[1024]], "retired": False}
    dumps = {0: [e(56, "completed"), e(57, "started"), e(900, "completed", pg="1")],
             1: [e(56, "completed"), e(1000, "completed", pg="1")],
             2: None}
    assert flight_recorder.summary(dumps) == (
        "collectives: rank 0 in nccl:all_reduce #57 of default_pg, sizes [[1024]] (started); "
        "rank 1 not in a collective (last finished in that group: nccl:all_reduce #56 of default_pg, sizes [[1024]]); "
        "rank 2: no flight recorder dump; rank(s) 1 never entered collective #57 (the others wait for them)")
    assert json.loads(json.dumps(dumps))    # the dumps are plain JSON, as written by the ranks
