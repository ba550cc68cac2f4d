"""The speed before launch (issue 45): the speed book's meter versions, the speed model's arithmetic against
figures computed by hand from published card specs, and `plan`'s speed lines, --card and --json."""

from __future__ import annotations

import json

import pytest

from shardconsole.cli import main as cli
from shardconsole.plan.speed import model as SM
from shardconsole.plan.speed.cards import CARDS, card_named, card_of
from shardconsole.plan.speed.host import HostRates
from shardconsole.plan.machine import Hardware
from shardconsole.plan.speed.book import SpeedBook, harvest, record_of
from shardconsole.runlog import protocol as P
from shardconsole.settings import config as C
from shardconsole.settings.models import resolve

GiB = 2**30
HOST = Hardware(gpus=1, gpu_memory_bytes=24 * GiB, host_memory_bytes=128 * GiB, gpu_name="NVIDIA GeForce RTX 4090",
                cpus=16)
FAST_HOST = HostRates(100.0, 16, "test")


def _cfg(*sets: str, model: str = "1b") -> C.RunConfig:
    # the chunked loss, whose head the arithmetic by hand counts twice forward (its backward recomputes the
    # logits); memory.loss's default (auto) is the fused one on a GPU: test_the_fused_loss_drops_the_recompute
    return C.build({"model": {"name": model}, "data": {"seq_len": 2048}, "parallel": {"device": "cuda"},
                    "train": {"micro_batch": 4, "steps": 100}, "memory": {"loss": "chunked"}}, "test", list(sets))


# ---------------------------------------------------------------------------------------------------
# The speed book: entries of the old meter never rank

def test_entries_without_the_meter_version_are_ignored_and_said_once(tmp_path):
    path = tmp_path / "speeds.jsonl"
    cfg = _cfg()
    new = record_of(cfg, HOST, 5000.0, "run")
    SpeedBook([], path).add(new)
    old = {**json.loads(path.read_text()), "tokens_per_s": 40000.0}
    del old["meter"]                                    # a line written before issue 45
    with path.open("a") as f:
        f.write(json.dumps(old) + "\n")
    book = SpeedBook.load(path)
    assert [r.tokens_per_s for r in book.records] == [5000.0] and book.stale == 1
    assert "1 speed(s)" in book.stale_note() and str(path) in book.stale_note()
    assert book.predict(cfg, HOST).value == 5000.0
    assert SpeedBook.load(tmp_path / "none.jsonl").stale_note() == ""


def _run_folder(root, name: str, grad_accum: int, meter: int):
    folder = root / name
    folder.mkdir(parents=True)
    cfg = _cfg(f"train.grad_accum={grad_accum}")
    C.save(cfg, folder / "preset.toml")
    lines = [P.Step(run=name, rank=0, step=s, steps=3, tokens_per_s=1000.0 * grad_accum, meter=meter)
             for s in (1, 2, 3)] + [P.Finished(run=name, rank=0, steps=3)]
    (folder / "metrics.jsonl").write_text("".join(P.encode(m) + "\n" for m in lines))


def test_harvest_leaves_out_old_meter_runs_with_accumulation(tmp_path):
    root = tmp_path / "runs"
    _run_folder(root, "a-old-accum", 4, 0)           # printed 4x its real speed
    _run_folder(root, "b-old-plain", 1, 0)           # right: one micro-batch a step
    _run_folder(root, "c-new-accum", 4, P.METER_VERSION)
    book = SpeedBook([], tmp_path / "speeds.jsonl")
    assert harvest(book, root, HOST) == 2
    assert sorted((r.run.rsplit("/", 1)[-1], r.grad_accum, r.meter) for r in book.records) == [
        ("b-old-plain", 1, P.METER_VERSION), ("c-new-accum", 4, P.METER_VERSION)]


# ---------------------------------------------------------------------------------------------------
# The cards: published figures

def test_cards_carry_their_published_figures():
    assert [c for c in ("rtx3090", "rtx4090", "rtx5090", "a100-40g", "a100-80g", "h100", "h200", "l40s") if c in CARDS] \
        == list(CARDS)
    assert (CARDS["rtx4090"].bf16_tflops, CARDS["rtx4090"].pcie_gen) == (165.2, 4)
    assert (CARDS["rtx3090"].bf16_tflops, CARDS["rtx3090"].memory_bytes) == (71.0, 24 * GiB)
    assert card_named("RTX 4090") is CARDS["rtx4090"] and card_named("a100") is CARDS["a100-80g"]
    assert card_of("NVIDIA A100-SXM4-40GB") is CARDS["a100-40g"] and card_of("NVIDIA H200") is CARDS["h200"]
    assert card_of("NVIDIA L40S") is CARDS["l40s"] and card_of("Tesla T4") is None
    with pytest.raises(ValueError, match="known: rtx3090"):
        card_named("rtx2080")


# ---------------------------------------------------------------------------------------------------
# The model's arithmetic, by hand

def _flops_1b(seq: int, recompute: bool) -> float:
    # 1b of the catalog: hidden 2048, 16 layers, vocab 32000, untied; N = 940,640,256
    n, L, h, V = 940_640_256, 16, 2048, 32000
    flops = 6 * n + 12 * L * h * seq + 2 * V * h
    if recompute:
        flops += 2 * (n - 2 * V * h) + 4 * L * h * seq
    return flops


def test_the_fused_loss_drops_the_recompute():
    """The fused loss works out the head's gradients in forward: no logits recomputed in backward, 2 V h a
    token less than the chunked loss; auto is the fused one on a GPU, and the default."""
    h, V = 2048, 32000
    chunked = SM.hardware_flops_per_token(_cfg(), resolve("1b"))
    for fused in (_cfg("memory.loss=fused"), _cfg("memory.loss=auto")):
        assert SM.hardware_flops_per_token(fused, resolve("1b")) == chunked - 2 * V * h == _flops_1b(2048, False) - 2 * V * h
    default = C.build({"model": {"name": "1b"}, "data": {"seq_len": 2048}, "parallel": {"device": "cuda"}}, "t")
    assert SM.hardware_flops_per_token(default, resolve("1b")) == chunked - 2 * V * h


def test_a_gpu_bound_step_is_its_flops_at_the_cards_rate():
    cfg = _cfg()
    assert SM.hardware_flops_per_token(cfg, resolve("1b")) == _flops_1b(2048, False)
    p = SM.predict(cfg, resolve("1b"), HOST, card=CARDS["rtx4090"], host=FAST_HOST)
    # 4 x 2048 tokens at 165.2 TFLOP/s x (790/989) x the eager efficiency (longer than the 16 layers'
    # launches, 16 x 3.6 ms), each optimizer step's 4.4 ms a layer, and AdamW on the GPU: 28 bytes a
    # parameter at 1008 GB/s x 0.7
    rate = 165.2e12 * 790 / 989 * 0.74
    expect = 8192 * _flops_1b(2048, False) / rate + 16 * 0.0044 + 940_640_256 * 28 / (1008e9 * 0.7)
    assert p.step_s == pytest.approx(expect, rel=1e-9)
    assert p.tokens_per_s == pytest.approx(8192 / expect, rel=1e-9) and p.bound == "GPU"
    # the same settings on a 3090 differ in the matmul part by the datasheets' ratio 165.2 / 71
    p3 = SM.predict(cfg, resolve("1b"), HOST, card=CARDS["rtx3090"], host=FAST_HOST)
    matmul = lambda tflops: 8192 * _flops_1b(2048, False) / (tflops * 1e12 * 790 / 989 * 0.74)  # noqa: E731
    opt3 = 940_640_256 * 28 / (936e9 * 0.7)
    assert p3.step_s - 16 * 0.0044 - opt3 == pytest.approx(matmul(71.0), rel=1e-9)
    assert matmul(71.0) / matmul(165.2) == pytest.approx(165.2 / 71.0)


def test_a_small_eager_micro_batch_is_bound_by_its_launches():
    """1b at mb 1 x 256 on an H200: the GPU's work (~0.006 s) hides under the launches of 16 layers (3.6 ms
    each, twice that checkpointed), counted once a micro-batch; the per-step cost once a step."""
    h200 = Hardware(gpus=1, gpu_memory_bytes=141 * 10**9, host_memory_bytes=128 * GiB, gpu_name="NVIDIA H200",
                    cpus=16)
    opt = 940_640_256 * 28 / (4800e9 * 0.7)
    small = ("data.seq_len=256", "train.micro_batch=1")
    p = SM.predict(_cfg(*small), resolve("1b"), h200, host=FAST_HOST)
    assert p.step_s == pytest.approx(16 * 0.0036 + 16 * 0.0044 + opt, rel=1e-9)
    ck = SM.predict(_cfg(*small, "memory.activation_checkpointing=true"), resolve("1b"), h200, host=FAST_HOST)
    assert ck.step_s == pytest.approx(2 * 16 * 0.0036 + 16 * 0.0044 + opt, rel=1e-9)
    ga = SM.predict(_cfg(*small, "train.grad_accum=4"), resolve("1b"), h200, host=FAST_HOST)
    assert ga.step_s == pytest.approx(4 * 16 * 0.0036 + 16 * 0.0044 + opt, rel=1e-9)
    assert ga.tokens_per_s == pytest.approx(4 * 256 / ga.step_s)


def test_checkpointing_recomputes_the_forward():
    cfg = _cfg("memory.activation_checkpointing=true")
    assert SM.hardware_flops_per_token(cfg, resolve("1b")) == _flops_1b(2048, True)
    sel = _cfg("memory.activation_checkpointing=true", "memory.checkpoint_policy=selective")
    assert SM.hardware_flops_per_token(sel, resolve("1b")) == _flops_1b(2048, False)


def test_lora_counts_its_own_flops():
    cfg = _cfg("train.method=lora", "lora.rank=16", model="7b")
    # 7b: hidden 4096, intermediate 11008, 32 layers; rank 16 on all 7 linears of a layer
    h, i, L, V, n = 4096, 11008, 32, 32000, 6_738_415_616
    adapters = L * 16 * (4 * (h + h) + 2 * (h + i) + (i + h))
    expect = 4 * n + 6 * adapters + 12 * L * h * 2048 + 2 * V * h
    assert SM.hardware_flops_per_token(cfg, resolve("7b")) == expect


def test_offload_step_is_gpu_plus_host_step_without_overlap():
    """FSDP2 offload with a clip: the host step after the backward. PCIe 4.0 x16 one way 27.2 GB/s (half
    of PCIe 5.0's 54.4 measured); the host step 33 bytes a parameter (30 read and written, +3 calibrated)
    over 100 GB/s."""
    cfg = _cfg("fsdp.cpu_offload=true", "train.clip_grad_norm=1.0", model="3b")
    spec = resolve("3b")
    n = spec.n_params
    p = SM.predict(cfg, spec, HOST, card=CARDS["rtx4090"], host=FAST_HOST)
    host = 33 * n / 100e9
    h2d = 4 * n / (27.2e9 * 25.0 / 54.4)          # fp32 masters: the shard goes at 25 of 54.4 GB/s's share
    d2h = 4 * n / (27.2e9 * 49.0 / 54.4)
    assert p.parts["host step"] == pytest.approx(host, rel=1e-9)
    assert p.parts["h2d"] == pytest.approx(h2d, rel=1e-9) and p.parts["d2h"] == pytest.approx(d2h, rel=1e-9)
    rate = 165.2e12 * 790 / 989 * 0.74
    # offloaded parameters: the layers' launches (5 ms each) add to the GPU's work rather than hide under it
    gpu = 8192 * SM.hardware_flops_per_token(cfg, spec) / rate + 26 * 0.005 + 0.85 * h2d
    assert p.step_s == pytest.approx(gpu + host, rel=1e-9)
    # without a clip the host step runs under the backward: the longer part plus half the shorter
    free = SM.predict(_cfg("fsdp.cpu_offload=true", "train.clip_grad_norm=0", model="3b"), spec, HOST,
                      card=CARDS["rtx4090"], host=FAST_HOST)
    assert free.step_s == pytest.approx(max(gpu, host) + 0.5 * min(gpu, host), rel=1e-9)
    # a PCIe 5.0 card moves the same bytes in half the time
    p5 = SM.predict(cfg, spec, HOST, card=CARDS["rtx5090"], host=FAST_HOST)
    assert p5.parts["h2d"] == pytest.approx(h2d / 2, rel=1e-9)


def test_accumulation_pays_the_host_step_once_a_step():
    spec = resolve("3b")
    one = SM.predict(_cfg("fsdp.cpu_offload=true", "train.clip_grad_norm=1.0", model="3b"), spec, HOST,
                     card=CARDS["rtx4090"], host=FAST_HOST)
    four = SM.predict(_cfg("fsdp.cpu_offload=true", "train.clip_grad_norm=1.0", "train.grad_accum=4", model="3b"),
                      spec, HOST, card=CARDS["rtx4090"], host=FAST_HOST)
    assert four.parts["gpu"] == pytest.approx(4 * one.parts["gpu"], rel=1e-9)
    assert four.parts["host step"] == one.parts["host step"]
    assert four.tokens_per_s > one.tokens_per_s


def test_the_time_to_finish_is_start_plus_steps():
    cfg = _cfg("train.compile=true")
    p = SM.predict(cfg, resolve("1b"), HOST, host=FAST_HOST)
    # 20 s to start, 2 s a billion parameters to build, 45 s to compile, then 100 steps
    assert p.start_s == pytest.approx(20 + 2 * 0.94064 + 45, rel=1e-6)
    assert p.seconds == pytest.approx(p.start_s + 100 * p.step_s, rel=1e-9)
    assert SM.predict(_cfg("parallel.device=cpu"), resolve("1b"), HOST) is None
    assert SM.predict(_cfg(), resolve("1b"), Hardware(1, 24 * GiB, 64 * GiB, "Some GPU")) is None


# ---------------------------------------------------------------------------------------------------
# The command

def test_plan_prints_the_speed_and_json_carries_it(capsys):
    assert cli.main(["plan", "--preset", "3090-7b-lora", "--card", "rtx4090", "--host-memory", "128GiB"]) in (0, 3)
    out = capsys.readouterr().out
    assert "speed (predicted, RTX 4090, this host):" in out and "GPU bound" in out and "50 steps:" in out
    assert "24.0 GiB" in out                    # the card's memory is the one planned
    assert cli.main(["plan", "--preset", "3090-7b-lora", "--card", "rtx3090", "--host-memory", "128GiB",
                     "--json"]) in (0, 3)
    d = json.loads(capsys.readouterr().out)
    assert d["card"] == "rtx3090" and d["predicted_tokens_per_s"] > 0
    assert d["predicted_seconds"] == pytest.approx(d["start_s"] + 50 * d["predicted_step_s"], rel=1e-3)


def test_plan_refuses_an_unknown_card_in_one_line(capsys):
    assert cli.main(["plan", "--preset", "3090-fsdp", "--card", "gtx1080"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--card: unknown card 'gtx1080'" in err


def test_two_ranks_pay_their_gathers_over_the_link():
    """FSDP2 full shard on two RTX 4090s: every parameter all-gathered twice in bf16 and reduce-scattered in
    fp32 a micro-batch, each rank sending half, over 0.8 of PCIe 4.0's 27.2 GB/s one way; no_shard
    all-reduces the gradients (2 x 4 bytes); the speed counts both ranks' tokens."""
    spec = resolve("1b")
    two = Hardware(gpus=2, gpu_memory_bytes=24 * GiB, host_memory_bytes=128 * GiB, gpu_name="RTX 4090", cpus=16)
    p = SM.predict(_cfg("parallel.nproc_per_node=2"), spec, two, host=FAST_HOST)
    assert p.parts["communication"] == pytest.approx(8 * spec.n_params / 2 / (0.8 * 27.2e9), rel=1e-9)
    one = SM.predict(_cfg(), spec, two, host=FAST_HOST)
    opt = spec.n_params * 28 / (1008e9 * 0.7)         # AdamW on the GPU, each rank stepping its half
    assert p.parts["communication"] < p.step_s == pytest.approx(one.step_s - opt / 2, rel=1e-9)
    assert p.tokens_per_s == pytest.approx(2 * 8192 / p.step_s, rel=1e-9)
    ddp = SM.predict(_cfg("parallel.nproc_per_node=2", "fsdp.sharding=no_shard"), spec, two, host=FAST_HOST)
    assert ddp.parts["communication"] == pytest.approx(8 * spec.n_params / 2 / (0.8 * 27.2e9), rel=1e-9)


def test_zero_with_compiled_layers_is_planned_at_its_measured_speed():
    """Issue 63: the h200-fsdp preset as ZeRO-3 (compiled layers, gathered by layer), H200, 16 host cores,
    measured 68,718 tokens/s in bf16 and 89,039 with fp8 tensorwise; planned with eager ZeRO's efficiency it
    was 21-22% slow. Both within 15% now, and eager ZeRO (train.compile off) stays slower than compiled."""
    import json
    from tests.conftest import shardconsole
    def planned(*sets):
        res = shardconsole("plan", "--preset", "h200-fsdp", "--card", "h200", "--host-cores", "16", "--json",
                           "--set", "parallel.backend=deepspeed", "--set", "deepspeed.stage=3",
                           *[a for s in sets for a in ("--set", s)])
        return json.loads(res.stdout)["predicted_tokens_per_s"]
    for sets, measured in (((), 68_718), (("precision.fp8=tensorwise",), 89_039)):
        assert abs(planned(*sets) / measured - 1) < 0.15, sets
    assert planned("train.compile=false") < planned()


def _preset_speed(preset: str, card: str, *sets: str) -> SM.SpeedPrediction:
    from shardconsole.settings import resolve as settings
    cfg = settings.resolve(preset, settings.from_cli(list(sets))).cfg
    h200_box = Hardware(gpus=1, gpu_memory_bytes=141 * 10**9, host_memory_bytes=125 * GiB, gpu_name="NVIDIA H200",
                        cpus=16)
    p = SM.predict(cfg, resolve(cfg.model.name), h200_box, card=CARDS[card])
    assert p is not None
    return p


def test_fp8_under_cpu_offload_pays_only_at_large_micro_batches():
    """Issue 63: fp8 tensorwise with the parameters on the host, measured (tokens/s, 24 GiB cap, 16 host
    cores): 13B (catalog "13b") bf16 masters + stochastic rounding at mb 9 x 2048 3,505 against bf16's 4,175
    (H200; fp8 costs); llama3-8b adam-mini (3090-8b-64gb) at mb 12 8,010 against 7,699 (H100, +4%); 7B fp32
    masters (3090-7b-offload) fp8 at mb 14 9,647 against bf16 at mb 12 7,971 (H200). The plan put the 13B at
    5,292 (+51%): each within 15% now, and fp8 planned slower than bf16 at 13B, faster at 8B and 7B."""
    s13 = ("model.name=13b", "precision.master_rounding=stochastic", "train.micro_batch=9")
    fp8 = ("precision.fp8=tensorwise",)
    f32 = ("precision.master_dtype=fp32",)
    rows = {"13b": (_preset_speed("3090-7b-offload", "h200", *s13),
                    _preset_speed("3090-7b-offload", "h200", *s13, *fp8), 4_175, 3_505),
            "8b": (_preset_speed("3090-8b-64gb", "h100"), _preset_speed("3090-8b-64gb", "h100", *fp8), 7_699, 8_010),
            "7b": (_preset_speed("3090-7b-offload", "h200", *f32),
                   _preset_speed("3090-7b-offload", "h200", *f32, *fp8, "train.micro_batch=14"), 7_971, 9_647)}
    for name, (bf16, f8, measured_bf16, measured_fp8) in rows.items():
        assert abs(measured_fp8 / f8.tokens_per_s - 1) < 0.15, (name, f8.tokens_per_s)
        assert abs(measured_bf16 / bf16.tokens_per_s - 1) < 0.16, (name, bf16.tokens_per_s)
        assert (f8.tokens_per_s > bf16.tokens_per_s) == (measured_fp8 > measured_bf16), name
    # ... and the plan says so, naming the micro-batch size from which it pays under offload (above the
    # 18,432 tokens where the 13B lost, below the 24,576 where the 8B and the 7B gained)
    slower = [n for n in rows["13b"][1].notes if n.startswith("precision.fp8: at 18,432 tokens")]
    assert len(slower) == 1 and "offloaded" in slower[0], rows["13b"][1].notes
    pays = int(slower[0].split("it pays from about ")[1].split(" ")[0].replace(",", ""))
    assert 18_432 < pays < 24_576, slower


def test_zero2_with_the_optimizer_on_the_host_is_planned_at_its_measured_speed():
    """Issue 63: the h200-fsdp preset as ZeRO-2 + offload_optimizer cpu, mb 3 under a 24 GiB cap (H200, 16
    host cores) measured 10,637 tokens/s; DeepSpeed's host step counted at ZeRO-3's slowdown planned it 12-15%
    slow. Within 5% now, and ZeRO-3 with the same offload stays the slower plan."""
    z2 = ("parallel.backend=deepspeed", "deepspeed.stage=2", "deepspeed.offload_optimizer=cpu", "train.micro_batch=3",
          "memory.gpu_memory_limit=24GiB")
    p = _preset_speed("h200-fsdp", "h200", *z2)
    assert p.bound == "host step" and abs(10_637 / p.tokens_per_s - 1) < 0.05, p.tokens_per_s
    z3 = _preset_speed("h200-fsdp", "h200", *z2, "deepspeed.stage=3")
    assert z3.parts["host step"] > p.parts["host step"]
