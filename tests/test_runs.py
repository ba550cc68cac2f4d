"""Real runs through the real headless path: torchrun, 2 CPU ranks over gloo, the tiny model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from shardconsole.settings import config as C
from shardconsole.launch.job import PRESET_FILE
from tests.conftest import assert_nothing_left, messages, of_kind, pids_alive, shardconsole, wait_for_steps

pytestmark = pytest.mark.slow


def test_headless_tiny_cpu_trains_and_ends_clean(fsdp_tiny_run):
    """conftest's shared run: train.steps=12, train.log_every=3."""
    run_dir, res = fsdp_tiny_run.run, fsdp_tiny_run.res
    assert res.returncode == 0, res.stderr + res.stdout
    step_lines = [l for l in res.stdout.splitlines() if l.startswith("step ")]
    assert [l.split()[1] for l in step_lines] == ["3/12", "6/12", "9/12", "12/12"]
    assert "tok/s" in step_lines[0] and "s/step" in step_lines[0] and "mem r0" in step_lines[-1]
    # The final save is said once, for a person; its host-peak records are the stream's, not the screen's.
    assert "saved step 12" in res.stdout and "save_host_peak" not in res.stdout, res.stdout

    msgs = messages(run_dir)
    steps = of_kind(msgs, "step")
    assert {m.rank for m in steps} == {0}
    assert [m.step for m in steps] == [3, 6, 9, 12]
    assert all(m.loss_scale is None and m.mfu is None and m.tokens_per_s > 0 for m in steps)
    assert steps[-1].loss < steps[0].loss - 0.5, [m.loss for m in steps]     # it learns
    assert {m.rank for m in of_kind(msgs, "memory")} == {0, 1}
    assert {m.rank for m in of_kind(msgs, "hello")} == {0, 1}
    assert of_kind(msgs, "host"), "the front end samples host memory into the stream"
    assert len(of_kind(msgs, "finished")) == 1 and not of_kind(msgs, "failed")
    # The resolved settings are a loadable preset equal to what ran.
    cfg = C.load(run_dir / PRESET_FILE)
    assert cfg.train.steps == 12 and cfg.parallel.nproc_per_node == 2
    assert_nothing_left(run_dir, msgs)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_mid_run_ends_every_rank(tmp_path, sig):
    """Ctrl-C, or SIGTERM (`timeout 120 shardconsole --headless ...`), to the front end that started the
    run stops it: every rank ended, none left."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless",
                             "--run-dir", str(run_dir), "--set", "train.steps=100000", "--set", "train.log_every=1",
                             "--set", "train.save_on_stop=false"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(run_dir, 1, 120, proc)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == 130, err
    assert took < 10, f"stop took {took:.1f}s"
    assert "none left" in err and "Traceback" not in err
    assert_nothing_left(run_dir, messages(run_dir))


def _steps_in(run_dir) -> int:
    return (run_dir / "metrics.jsonl").read_text().count('"kind":"step"')


def _read_until(stream, predicate, timeout: float) -> list[str]:
    """Lines of a live front end's stdout until one matches (the front end prints as the run goes)."""
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=max(0.0, deadline - time.monotonic())):
            line = stream.readline()
            if not line:
                break
            lines.append(line)
            if predicate(line):
                return lines
    pytest.fail(f"no matching line within {timeout:.0f}s: {lines[-5:]}")


def test_front_ends_die_the_run_goes_on_then_stop_ends_it(tmp_path):
    """Issue 14 item 4 on one real run: the starting front end's stdout closes (`| head -3`): exit 8, no
    traceback, the ranks train on and the folder says the front end detached. An attach hung up on
    (SIGHUP): exit 8, still training. A second attach follows while `shardconsole stop` ends every rank:
    that attach reports "stopped" (130), not a crash. Then stop and attach on the stopped run say so."""
    run_dir = tmp_path / "run"
    front = subprocess.Popen([sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless",
                              "--run-dir", str(run_dir), "--set", "train.steps=5000", "--set", "train.log_every=1",
                              "--set", "train.save_on_stop=false"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(3):
        front.stdout.readline()
    front.stdout.close()                                  # what `| head -3` does after three lines
    front.wait(timeout=120)
    err = front.stderr.read()
    assert front.returncode == 8, err
    assert "Traceback" not in err and "detached (its output pipe closed): the run goes on" in err
    msgs = messages(run_dir)
    assert any(e.name == "detached" for e in of_kind(msgs, "event"))
    n = _steps_in(run_dir)
    wait_for_steps(run_dir, n + 3, 60)                    # the ranks train on, nothing watching them

    attach = subprocess.Popen([sys.executable, "-m", "shardconsole", "attach", str(run_dir), "--headless"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _read_until(attach.stdout, lambda l: l.startswith("step "), 60)
    attach.send_signal(signal.SIGHUP)
    out, err = attach.communicate(timeout=30)
    assert attach.returncode == 8 and "the terminal closed" in err and "Traceback" not in err, err
    n = _steps_in(run_dir)
    wait_for_steps(run_dir, n + 3, 60)

    watching = subprocess.Popen([sys.executable, "-m", "shardconsole", "attach", str(run_dir), "--headless"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _read_until(watching.stdout, lambda l: l.startswith("step "), 60)
    res = shardconsole("stop", str(run_dir), timeout=60)
    assert res.returncode == 0 and "none left" in res.stderr, res.stderr
    out, err = watching.communicate(timeout=60)
    assert watching.returncode == 130 and "run stopped by `shardconsole stop`" in err, err
    msgs = messages(run_dir)
    assert_nothing_left(run_dir, msgs)

    again = shardconsole("stop", str(run_dir), timeout=60)
    assert again.returncode == 0 and "nothing to stop: the run has already ended (stopped)" in again.stderr
    later = shardconsole("attach", str(run_dir), "--headless", timeout=60)
    assert later.returncode == 130 and "run stopped" in later.stderr and "Traceback" not in later.stderr


def test_stop_refuses_what_it_cannot_stop(tmp_path):
    res = shardconsole("stop", str(tmp_path), timeout=60)
    assert res.returncode == 2 and "not a run folder" in res.stderr
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    C.save(C.build({}), run_dir / PRESET_FILE)
    (run_dir / "job.json").write_text('{"pid": 1, "pgid": 1, "argv": [], "host": "another-node"}')
    res = shardconsole("stop", str(run_dir), timeout=60)
    assert res.returncode == 2 and "started on host another-node" in res.stderr, res.stderr
    (run_dir / "job.json").unlink()
    res = shardconsole("stop", str(run_dir), timeout=60)
    assert res.returncode == 2 and "started elsewhere" in res.stderr


@pytest.mark.parametrize("argv", [["presets"], ["plan", "--preset", "tiny-cpu"]])
def test_output_into_a_closed_pipe_is_a_quiet_exit(argv):
    """`shardconsole plan ... | head -1`: the reader is gone before the first write (closed here before the
    interpreter has even started), so the write fails for certain: exit 141, nothing on stderr about it."""
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err


def test_a_deleted_stream_does_not_make_a_healthy_run_hung(tmp_path):
    """Issue 22 item 14: metrics.jsonl deleted mid-run. The ranks write on through their open files, the
    front end reads on through its own and says so; the run finishes (a hang watch of 6 s never fires)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless",
                             "--run-dir", str(run_dir), "--set", "train.steps=120", "--set", "train.log_every=1",
                             "--set", "train.hang_timeout_s=6"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(run_dir, 5, 120, proc)
    hellos = [m.pid for m in of_kind(messages(run_dir), "hello")]
    (run_dir / "metrics.jsonl").unlink()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert "was deleted; still reading" in err and "finished: 120 steps" in err
    assert "step 120/120" in out
    assert pids_alive(hellos) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_machine(tmp_path):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1), one rank each, one shared folder,
    with hybrid_shard: a (2 nodes x 1 rank) mesh that replicates across the nodes."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
            "--set", "parallel.nnodes=2", "--set", "parallel.nproc_per_node=1",
            "--set", f"parallel.rdzv_endpoint=127.0.0.1:{_free_port()}", "--set", "train.steps=6",
            "--set", "fsdp.sharding=hybrid_shard",
            "--set", "train.log_every=3"]
    nodes = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    deadline = time.monotonic() + 60      # the first agent creates the folder; the second joins it
    while not (run_dir / PRESET_FILE).is_file():
        assert time.monotonic() < deadline and nodes[0].poll() is None, "the first agent made no run folder"
        time.sleep(0.05)
    nodes.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [n.communicate(timeout=240) for n in nodes]
    for n, (out, err) in zip(nodes, results):
        assert n.returncode == 0, err
    msgs = messages(run_dir)
    hellos = of_kind(msgs, "hello")
    assert sorted(h.rank for h in hellos) == [0, 1] and {h.world for h in hellos} == {2}
    assert [m.step for m in of_kind(msgs, "step")] == [3, 6]
    assert len(of_kind(msgs, "finished")) == 1
    # issue 32: each node's agent has a file of its own (the second did not overwrite the first's) ...
    from shardconsole.launch.job import ExternalJob, Job, open_run
    from shardconsole.runlog.runfolder import RunFolder
    agents = RunFolder(run_dir).agents()
    assert len(agents) == 2 and not (run_dir / "job.json").exists()
    pids = {json.loads(a.read_text())["pid"] for a in agents}
    assert len(pids) == 2 and all(f".{pid}.json" in " ".join(a.name for a in agents) for pid in pids)
    # ... and attach names every node's; a node 1 elsewhere (its file as that host writes it) is listed, not read
    here = json.loads(agents[0].read_text())
    (run_dir / "job.node1.977.json").write_text(json.dumps({**here, "host": "node1", "pid": 977}))
    assert RunFolder(run_dir).job in agents and isinstance(open_run(run_dir), Job)
    res = shardconsole("attach", str(run_dir), "--headless", timeout=60)
    assert res.returncode == 0, res.stderr
    assert "finished: 6 steps" in res.stderr
    assert res.stderr.count(f"{socket.gethostname()} pid ") == 2 and "node1 pid 977" in res.stderr, res.stderr
    for a in agents:        # seen from a third machine: every agent is elsewhere, the stream tells the end
        a.unlink()
    assert isinstance(open_run(run_dir), ExternalJob)


def test_checkpoint_then_resume_continues(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = tmp_path / "first"
    common = ["--preset", "tiny-cpu", "--headless", "--set", f"train.checkpoint_dir={ckpt}",
              "--set", "train.log_every=1", "--set", "train.schedule=constant", "--set", "train.warmup_steps=0"]
    res = shardconsole(*common, "--run-dir", str(first), "--set", "train.steps=6", "--set", "train.checkpoint_every=3")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000003", "step_00000006"]
    first_steps = of_kind(messages(first), "step")
    saved = [m for m in of_kind(messages(first), "event") if m.name == "checkpoint_saved"]
    assert len(saved) == 2

    # A half-written checkpoint (a kill mid-save) must never be picked.
    (ckpt / "step_00000009.partial").mkdir()
    second = tmp_path / "second"
    res = shardconsole(*common, "--run-dir", str(second), "--set", "train.steps=9", "--set", "train.resume=true")
    assert res.returncode == 0, res.stderr
    msgs = messages(second)
    steps = of_kind(msgs, "step")
    assert [m.step for m in steps] == [7, 8, 9]
    assert any("resumed from" in m.detail and "step_00000006" in m.detail for m in of_kind(msgs, "event"))
    # The model came back trained: its loss continues from where the first run ended, far below the start.
    assert steps[0].loss < first_steps[0].loss - 0.5
    assert abs(steps[0].loss - first_steps[-1].loss) < 0.5


def test_local_model_folder_and_text_data(tmp_path):
    """A Hugging Face folder (config + safetensors) loads on rank 0 and reaches the other rank's shards;
    a text file is tokenized as bytes (no tokenizer in the folder: asked for with data.tokenizer = "bytes",
    since issue 36 item 1 refuses such a folder otherwise)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardconsole.settings.models import CATALOG
    model_dir = tmp_path / "my-llama"
    torch_cfg = LlamaConfig(**CATALOG["tiny"])
    model = LlamaForCausalLM(torch_cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(200.0)   # a signature: confident wrong logits, a first loss far above ln(256)
    model.save_pretrained(model_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 300)
    run_dir = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
                       "--set", f"model.name={model_dir}", "--set", "data.source=text",
                       "--set", f"data.path={corpus}", "--set", "data.seq_len=64", "--set", "data.tokenizer=bytes",
                       "--set", "train.steps=8", "--set", "train.log_every=1")
    assert res.returncode == 0, res.stderr
    msgs = messages(run_dir)
    hello = of_kind(msgs, "hello")[0]
    assert hello.n_params == sum(p.numel() for p in LlamaForCausalLM(torch_cfg).parameters())
    steps = of_kind(msgs, "step")
    # Step 1's loss is measured before any update: the saved weights' signature shows, where a random
    # init would start near ln(256) = 5.5.
    assert steps[0].loss > 10, steps[0].loss
    assert steps[-1].loss < steps[0].loss

    (model_dir / "model.safetensors").unlink()
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--set", f"model.name={model_dir}", timeout=60)
    assert res.returncode == 2 and "no weights" in res.stderr


def test_front_end_killed_then_attach_sees_every_line(tmp_path):
    """kill -9 of the headless front end leaves the job running; attach replays and follows it."""
    run_dir = tmp_path / "run"
    front = subprocess.Popen([sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless",
                              "--run-dir", str(run_dir), "--set", "train.steps=40", "--set", "train.log_every=1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_steps(run_dir, 2, 120, front)
    front.kill()
    front.wait()
    res = shardconsole("attach", str(run_dir), "--headless")
    assert res.returncode == 0, res.stderr
    msgs = messages(run_dir)
    assert [m.step for m in of_kind(msgs, "step")] == list(range(1, 41))
    printed = [l.split()[1] for l in res.stdout.splitlines() if l.startswith("step ")]
    assert printed == [f"{i}/40" for i in range(1, 41)]     # the whole history, then the rest live
    assert_nothing_left(run_dir, msgs)


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_kill_mid_checkpoint_then_resume_from_the_previous_one(tmp_path, backend):
    """SIGKILL of every process while step 4's checkpoint is being written: resume picks step 2's."""
    from shardconsole.launch.job import Job
    ckpt, first = tmp_path / "ckpt", tmp_path / "first"
    common = ["--preset", "tiny-cpu", "--headless", "--set", f"parallel.backend={backend}",
              "--set", f"train.checkpoint_dir={ckpt}", "--set", "train.log_every=1", "--set", "train.checkpoint_every=2"]
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", *common, "--run-dir", str(first),
                             "--set", "train.steps=6"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "SHARDCONSOLE_FAULT": "slow_save@step=4"})
    deadline = time.monotonic() + 180
    while not (ckpt / "step_00000004.partial").exists():
        assert time.monotonic() < deadline, "the step-4 checkpoint never started"
        time.sleep(0.1)
    # Mid-save now (slow_save holds step 4's save open); what the kill needs is every rank's pid.
    while len(hellos := [m.pid for m in of_kind(messages(first), "hello")]) < 2:
        assert time.monotonic() < deadline, "the ranks' hello lines never came"
        time.sleep(0.05)
    # A crash mid-save: SIGKILL to every process of the run at once (a stop would now wait the save out,
    # session/stop._Wait, which is what keeps work; this is the machine dying under it).
    pids = Job.from_run_dir(first).processes(tuple(hellos))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()
    while pids_alive(pids):
        assert time.monotonic() < deadline, f"{pids_alive(pids)} outlived SIGKILL"
        time.sleep(0.05)
    assert (ckpt / "step_00000002").is_dir() and not (ckpt / "step_00000004").exists()

    second = tmp_path / "second"
    res = shardconsole(*common, "--run-dir", str(second), "--set", "train.steps=6", "--set", "train.resume=true")
    assert res.returncode == 0, res.stderr
    msgs = messages(second)
    assert [m.step for m in of_kind(msgs, "step")] == [3, 4, 5, 6]
    assert any("step_00000002" in m.detail for m in of_kind(msgs, "event") if m.name == "info")
    assert (ckpt / "step_00000006").is_dir()


def test_bf16_masters_with_offload_and_selective_checkpointing(tmp_path):
    """precision.master_dtype = "bf16" keeps the weights and Adam's moments in bf16 (8 bytes a
    parameter): the checkpoint the run writes holds bf16 tensors, and the run still learns."""
    from torch.distributed.checkpoint import FileSystemReader
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
                       "--set", "precision.dtype=bf16", "--set", "precision.master_dtype=bf16",
                       "--set", "fsdp.cpu_offload=true", "--set", "memory.activation_checkpointing=true",
                       "--set", "memory.checkpoint_policy=selective", "--set", "train.steps=12",
                       "--set", "train.log_every=3", "--set", "train.save_final=true",
                       "--set", f"train.checkpoint_dir={ckpt}")
    assert res.returncode == 0, res.stderr + res.stdout
    steps = of_kind(messages(run_dir), "step")
    assert steps[-1].loss < steps[0].loss - 0.3, [m.loss for m in steps]
    meta = FileSystemReader(str(ckpt / "step_00000012")).read_metadata().state_dict_metadata
    weights = {k: v for k, v in meta.items() if k.startswith("model.") and k.endswith("q_proj.weight")}
    moments = {k: v for k, v in meta.items() if k.startswith("optim.state.") and k.endswith("exp_avg")}
    assert weights and moments
    assert {str(v.properties.dtype) for v in [*weights.values(), *moments.values()]} == {"torch.bfloat16"}


def test_offload_compute_copy_trains_the_same_model_and_follows_a_resume(tmp_path):
    """fsdp.offload_compute_copy: the all-gathers read a bf16 host copy of the fp32 shards. The copy must
    be the shards' values at every step: after a resume (loaded after the copy was first made) and after
    each optimizer step. Resumed from one checkpoint, with and without the copy, the runs are identical.
    The copy's run also overlaps the host step with the backward (fsdp.offload_overlap: each unit's copy
    refreshed after its own step, the resumed state stepped unit by unit), the other steps after it."""
    ckpt = tmp_path / "ckpt"
    base = ["--preset", "tiny-cpu", "--headless", "--set", "precision.dtype=bf16", "--set", "fsdp.cpu_offload=true",
            "--set", f"train.checkpoint_dir={ckpt}", "--set", "train.log_every=1", "--set", "train.clip_grad_norm=0"]
    res = shardconsole(*base, "--run-dir", str(tmp_path / "first"), "--set", "train.steps=3",
                       "--set", "train.save_final=true", "--set", "fsdp.offload_compute_copy=false")
    assert res.returncode == 0, res.stderr
    losses = {}
    for copy in ("true", "false"):
        run_dir = tmp_path / f"copy-{copy}"
        # No final save: the second resume must start from step 3 again, not from the first one's step 6.
        res = shardconsole(*base, "--run-dir", str(run_dir), "--set", "train.steps=6", "--set", "train.resume=true",
                           "--set", "train.save_final=false", "--set", f"fsdp.offload_compute_copy={copy}",
                           "--set", f"fsdp.offload_overlap={copy}")
        assert res.returncode == 0, res.stderr
        steps = of_kind(messages(run_dir), "step")
        assert [m.step for m in steps] == [4, 5, 6]
        losses[copy] = [(m.loss, m.grad_norm) for m in steps]
        log = (run_dir / "logs" / "rank0.log").read_text()
        assert ("bf16 host copy of" in log) == (copy == "true"), log[-2000:]
        assert ("host step starts when its gradients reach the host" in log) == (copy == "true"), log[-2000:]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-6), losses
