"""Launch argv for one node and several, with no shell anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardconsole.settings import config as C
from shardconsole.launch.job import build_argv, new_run_dir, slurm_script
from tests.conftest import shardconsole


def test_single_node_torchrun():
    cfg = C.build({"parallel": {"nproc_per_node": 2}})
    argv = build_argv(cfg, Path("runs/x"), "x", python="py")
    # torchrun through the wrapper whose stores listen on loopback (a real run checks it: test_run_faults)
    assert argv[:3] == ["py", "-m", "shardconsole.launch.loopback_torchrun"]
    assert "--nproc-per-node=2" in argv and "--nnodes=1" in argv and "--standalone" not in argv
    assert "--rdzv-endpoint=127.0.0.1:0" in argv and "--local-addr=127.0.0.1" in argv
    assert argv[-6:] == ["-m", "shardconsole.backends", "--run-dir", "runs/x", "--run-id", "x"]


def test_fixed_port():
    argv = build_argv(C.build({"parallel": {"master_port": 29511}}), Path("r"), "r", python="py")
    assert "--rdzv-endpoint=127.0.0.1:29511" in argv and "--standalone" not in argv


def test_multi_node_rendezvous():
    cfg = C.build({}, overrides=["parallel.nnodes=2", "parallel.rdzv_endpoint=host:29400",
                                 "parallel.nproc_per_node=8"])
    argv = build_argv(cfg, Path("r"), "run7", python="py")
    assert "--nnodes=2" in argv and "--nproc-per-node=8" in argv
    assert "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=host:29400" in argv
    assert "--rdzv-id=run7" in argv and "--standalone" not in argv
    cfg.parallel.node_rank = 1
    assert "--node-rank=1" in build_argv(cfg, Path("r"), "run7", python="py")
    # how long nodes wait for each other: torch's defaults unless set, always said on the line
    assert "--rdzv-conf=read_timeout=60,join_timeout=600" in argv
    cfg = C.build({}, overrides=["parallel.nnodes=2", "parallel.rdzv_endpoint=host:29400",
                                 "parallel.rdzv_connect_timeout_s=900", "parallel.rdzv_join_timeout_s=1800"])
    assert "--rdzv-conf=read_timeout=900,join_timeout=1800" in build_argv(cfg, Path("r"), "run7", python="py")
    # one node: loopback_torchrun's own rendezvous, nobody to wait for
    assert not any(a.startswith("--rdzv-conf") for a in build_argv(C.build({}), Path("r"), "r", python="py"))


def test_rendezvous_timeouts_are_validated():
    for bad in ("parallel.rdzv_connect_timeout_s=0", "parallel.rdzv_join_timeout_s=-5"):
        with pytest.raises(C.ConfigError, match=bad.split("=")[0].split(".")[1]):
            C.build({}, overrides=["parallel.nnodes=2", "parallel.rdzv_endpoint=host:29400", bad])


def test_deepspeed_launcher():
    cfg = C.build({"parallel": {"backend": "deepspeed", "launcher": "deepspeed", "nproc_per_node": 2}})
    argv = build_argv(cfg, Path("r"), "r", python="py")
    assert argv[:3] == ["py", "-m", "deepspeed.launcher.runner"]
    assert "--num_gpus=2" in argv and "--module" in argv


def test_hostile_values_stay_single_arguments():
    cfg = C.build({}, overrides=["parallel.nnodes=2", "parallel.rdzv_endpoint=h:1"])
    argv = build_argv(cfg, Path("runs/a; rm -rf ~"), "id $(x)", python="py")
    assert "runs/a; rm -rf ~" in argv and "id $(x)" in argv


def test_new_run_dir_is_unique(tmp_path):
    a = new_run_dir("tiny-cpu", tmp_path)
    a.mkdir()
    b = new_run_dir("tiny-cpu", tmp_path)
    assert a != b and a.name.endswith("tiny-cpu")


def test_print_command_cli(tmp_path):
    res = shardconsole("--preset", "tiny-cpu", "--print-command", "--run-dir", str(tmp_path / "r"), timeout=60)
    assert res.returncode == 0, res.stderr
    assert "shardconsole.launch.loopback_torchrun" in res.stdout and "--nproc-per-node=2" in res.stdout
    # the printed command reads the run folder's preset: it is written, with the resolved settings
    assert C.load(tmp_path / "r" / "preset.toml").parallel.nproc_per_node == 2
    res = shardconsole("--preset", "tiny-cpu", "--print-command", "--set", "parallel.nnodes=2",
                       "--set", "parallel.rdzv_endpoint=host:29400", "--run-dir", str(tmp_path / "m"), timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--rdzv-endpoint=host:29400" in res.stdout and "--nnodes=2" in res.stdout
    assert sys.executable in res.stdout and "each of the 2 nodes" in res.stderr


def test_slurm_script(tmp_path):
    cfg = C.build({}, overrides=["parallel.nnodes=4", "parallel.nproc_per_node=8", "parallel.device=cuda",
                                 "parallel.backend=deepspeed",
                                 "parallel.rdzv_endpoint=n0:29500"], gpu_count=None)
    text = slurm_script(cfg, tmp_path / "run dir", "id-1", python="/opt/py", workdir=tmp_path)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert {"#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive",
            "#SBATCH --signal=B:USR1@360", "#SBATCH --requeue"} <= set(lines)
    assert not any(line.startswith("#SBATCH --mem") for line in lines)      # no planner figure given
    assert "#SBATCH --mem=11G" in slurm_script(cfg, tmp_path, "id-1", python="py", host_bytes=10 * 2**30)
    srun = next(line for line in lines if line.startswith("srun "))
    # one torchrun agent a node (even for a DeepSpeed run: no hostfile, no ssh), rendezvous on the first node
    assert "/opt/py -m torch.distributed.run --nproc-per-node=8" in srun
    assert '--rdzv-endpoint="$head_node:29500"' in srun and '--rdzv-id="$SLURM_JOB_ID"' in srun
    assert f"--run-dir '{tmp_path / 'run dir'}'" in srun          # quoted: the path has a space
    assert '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in srun and '--run-id "$session"' in srun
    assert "--rdzv-conf=read_timeout=60,join_timeout=600" in srun
    late = C.build({}, overrides=["parallel.device=cpu", "parallel.rdzv_connect_timeout_s=300"])
    assert "--rdzv-conf=read_timeout=300,join_timeout=600" in slurm_script(late, tmp_path, "x", python="py")
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    # CPU ranks: no GPUs asked of Slurm, and the ranks told not to take one; a port per job
    cpu = slurm_script(C.build({}, overrides=["parallel.device=cpu"]), tmp_path, "x", python="py")
    assert "--gpus-per-node" not in cpu and "export CUDA_VISIBLE_DEVICES=''" in cpu
    assert "SLURM_JOB_ID % 20000" in cpu


def test_slurm_script_names_cannot_inject_lines_or_commands(tmp_path):
    """Issue 22 item 10: a newline or $(...) in the run folder's name stays inside one line / one word."""
    evil = "r\nrm -rf $(touch PWNED)\n#SBATCH --nodes=99"
    cfg = C.build({}, overrides=["parallel.device=cpu"])
    C.save(cfg, tmp_path / evil / "preset.toml")       # the script's first step reads the folder's settings
    text = slurm_script(cfg, tmp_path / evil, evil, python=sys.executable, workdir=tmp_path)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    lines = text.splitlines()
    comment = [line for line in lines if line.startswith("# shardconsole run ")]
    assert len(comment) == 1 and "\\n" in comment[0]                 # escaped, still one line
    assert not any(line.startswith(("rm ", "#SBATCH --nodes=99")) for line in lines)
    assert [line for line in lines if line.startswith("#SBATCH --nodes=")] == ["#SBATCH --nodes=1"]
    # run for real (srun and scontrol stand-ins on PATH): no command of the name runs, and the rank
    # command still receives the name byte for byte
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho n0\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {tmp_path / 'srun.args'}\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    res = subprocess.run(["bash", "-c", text], cwd=tmp_path, text=True, capture_output=True,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_NNODES": "1",
                              "SLURM_JOB_NODELIST": "n0", "SLURM_CPUS_ON_NODE": "2",
                              "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "PWNED").exists()
    args = (tmp_path / "srun.args").read_bytes().decode().split("\0")
    assert args[args.index("--run-dir") + 1] == str((tmp_path / evil).resolve())
    assert args[args.index("--run-id") + 1] == evil


def test_one_explicit_run_dir_one_winner(tmp_path):
    """Issue 22 item 5: launches racing for one --run-dir: exactly one creates it."""
    import threading
    from shardconsole.session.rundir import RunDirError, create_run_dir
    cfg = C.build({})
    target, n = tmp_path / "runs" / "same", 8
    barrier, won, lost = threading.Barrier(n), [], []

    def launch():
        barrier.wait()
        try:
            won.append(create_run_dir(cfg, target, explicit=True))
        except RunDirError as e:
            lost.append(str(e))

    threads = [threading.Thread(target=launch) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won == [target] and len(lost) == n - 1
    assert all("folder exists" in why for why in lost)
    assert C.load(target / "preset.toml") == cfg


def test_default_names_in_one_second_both_start(tmp_path):
    """Two default launches in the same second get two folders (the second a suffix); no refusal
    naming a --run-dir the user never gave."""
    from shardconsole.session.rundir import create_run_dir
    cfg = C.build({})
    name = new_run_dir("tiny-cpu", tmp_path)          # both launches computed this name
    a = create_run_dir(cfg, name, explicit=False)
    b = create_run_dir(cfg, name, explicit=False)
    assert a == name and b == name.with_name(name.name + "-2")
    assert (a / "preset.toml").is_file() and (b / "preset.toml").is_file()


def test_empty_folder_made_by_the_user_is_taken_a_full_one_refused(tmp_path):
    from shardconsole.session.rundir import RunDirError, create_run_dir
    cfg = C.build({})
    (tmp_path / "empty").mkdir()
    assert create_run_dir(cfg, tmp_path / "empty") == tmp_path / "empty"
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="folder exists"):
        create_run_dir(cfg, tmp_path / "home")
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["notes.txt"]


def test_fixed_master_port_in_use_is_refused_before_launch(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = shardconsole("--preset", "tiny-cpu", "--headless", "--set", f"parallel.master_port={port}",
                           "--run-dir", str(tmp_path / "r"), timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "master_port" in res.stderr and f"port {port} is already in use" in res.stderr
    assert not (tmp_path / "r").exists()


@pytest.fixture
def read_only_mount(tmp_path):
    """A real read-only filesystem (root ignores permission bits, not a read-only mount)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
    if res.returncode != 0:     # no mount here: a folder without write permission does it for non-root
        assert os.getuid() != 0, f"cannot mount a read-only tmpfs as root: {res.stderr!r}"
        ro.chmod(0o555)
        yield ro
        ro.chmod(0o755)
        return
    yield ro
    subprocess.run(["umount", str(ro)], check=True)


def test_read_only_runs_folder_one_line_exit_2(read_only_mount, tmp_path):
    """Issue 22 item 6: a read-only runs root (default run folder) and a read-only --run-dir: one line, exit 2."""
    res = shardconsole("--preset", "tiny-cpu", "--headless", timeout=60,
                       env={"SHARDCONSOLE_RUNS_ROOT": str(read_only_mount / "runs")})
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "Traceback" not in res.stderr and "runs" in res.stderr
    res = shardconsole("--preset", "tiny-cpu", "--print-command", "--run-dir", str(read_only_mount / "r"), timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "Read-only file system" in res.stderr or "Permission denied" in res.stderr


def test_read_only_checkpoint_dir_found_before_launch(read_only_mount, tmp_path):
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--set", f"train.checkpoint_dir={read_only_mount / 'ck'}",
                       "--run-dir", str(tmp_path / "r"), timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "checkpoint_dir" in res.stderr and str(read_only_mount) in res.stderr
    assert not (tmp_path / "r").exists()       # refused before anything was written


def test_the_run_folder_keeps_absolute_paths(tmp_path, monkeypatch):
    """Relative paths are read from where the run starts; the run folder's preset.toml holds them
    absolute, so resume, attach and export-model work from any directory."""
    from shardconsole.session.rundir import create_run_dir
    (tmp_path / "model").mkdir()
    (tmp_path / "tiny").mkdir()          # a folder named like a catalog size does not shadow the size
    monkeypatch.chdir(tmp_path)
    cfg = C.build({"model": {"name": "model"}, "data": {"path": "d/chats.jsonl", "eval_path": "d/eval.jsonl"},
                   "train": {"checkpoint_dir": "ckpt"}})
    run = create_run_dir(cfg, tmp_path / "runs" / "r")
    saved = C.load(run / "preset.toml")
    assert saved.model.name == str(tmp_path / "model")
    assert saved.data.path == str(tmp_path / "d" / "chats.jsonl")
    assert saved.data.eval_path == str(tmp_path / "d" / "eval.jsonl")
    assert saved.train.checkpoint_dir == str(tmp_path / "ckpt")
    cfg.model.name = "tiny"
    saved = C.load(create_run_dir(cfg, tmp_path / "runs" / "t") / "preset.toml")
    assert saved.model.name == "tiny"


def test_torchrun_waits_for_a_save_on_stop():
    """torchrun SIGKILLs its workers 30 s after forwarding a SIGTERM unless told otherwise: a run that saves
    on stop gives it stop_save_timeout_s and a margin; one that does not leaves torchrun's default."""
    from shardconsole.launch.command import child_env
    cfg = C.build({"train": {"stop_save_timeout_s": 100}})
    assert child_env(cfg, base={})["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "130"
    cfg.train.save_on_stop = False
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in child_env(cfg, base={})


def test_the_flight_recorder_variable_is_the_one_the_installed_torch_reads(tmp_path):
    """Setting the old TORCH_NCCL_TRACE_BUFFER_SIZE beside the new name made torch warn in every rank's
    log (issue 36 item 10): the ranks and the Slurm script get the one name the installed torch reads."""
    import importlib.util
    from shardconsole.launch.command import child_env
    from shardconsole.machine import flight_recorder as fr
    header = Path(importlib.util.find_spec("torch").submodule_search_locations[0]).joinpath(*fr._FR_HEADER)
    new = '"TORCH_FR_BUFFER_SIZE"' in header.read_text()
    env = child_env(C.build({}), base={})
    assert {k for k in env if k in fr.ENV_VARS} == {"TORCH_FR_BUFFER_SIZE" if new else "TORCH_NCCL_TRACE_BUFFER_SIZE"}
    # a torch from before the rename (its header knows only the old name), and one without headers
    old = tmp_path / "torch"
    old.joinpath(*fr._FR_HEADER[:-1]).mkdir(parents=True)
    old.joinpath(*fr._FR_HEADER).write_text('max_entries_ = getCvarInt({"TORCH_NCCL_TRACE_BUFFER_SIZE"}, 0);')
    assert fr.buffer_env_var(old) == fr.buffer_env_var(tmp_path / "none") == "TORCH_NCCL_TRACE_BUFFER_SIZE"
    # a user's own setting, under either name, is left alone and not doubled
    assert {k: v for k, v in child_env(C.build({}), base={"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}).items()
            if k in fr.ENV_VARS} == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    script = slurm_script(C.build({}), tmp_path / "run", "r1")
    assert ("TORCH_NCCL_TRACE_BUFFER_SIZE" in script) != new


def test_an_offloaded_run_of_several_ranks_a_node_splits_the_host_cores(tmp_path):
    """torchrun gives each of several ranks OMP_NUM_THREADS=1 unless it is set: an offloaded run's host
    optimizer step would run on one core. The launch (and the sbatch script, from Slurm's count) splits
    the node's cores between its ranks; one rank, no offload, CPU ranks or the user's own value: unset."""
    import os
    from shardconsole.launch import command as launch_command
    two = ["parallel.device=cuda", "parallel.nproc_per_node=2"]
    fsdp = C.build({}, overrides=[*two, "fsdp.cpu_offload=true"], gpu_count=None)
    zero = C.build({}, overrides=[*two, "parallel.backend=deepspeed", "deepspeed.stage=3",
                                  "deepspeed.offload_optimizer=cpu"], gpu_count=None)
    cores = len(os.sched_getaffinity(0))
    for cfg in (fsdp, zero):
        assert launch_command.launch_env(cfg, {})["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert launch_command.launch_env(fsdp, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    for overrides in (two, ["parallel.device=cuda", "fsdp.cpu_offload=true"],
                      ["parallel.device=cpu", "parallel.nproc_per_node=2", "fsdp.cpu_offload=true"]):
        assert "OMP_NUM_THREADS" not in launch_command.launch_env(C.build({}, overrides=overrides, gpu_count=None), {})
    script = slurm_script(C.build({}, overrides=[*two, "parallel.nnodes=2", "parallel.rdzv_endpoint=n0:29500",
                                                 "fsdp.cpu_offload=true"], gpu_count=None),
                          tmp_path, "x", python="py")
    line = next(x for x in script.splitlines() if x.startswith("export OMP_NUM_THREADS="))
    for on_node, want in (("32", "16"), ("1", "1")):
        got = subprocess.run(["bash", "-c", f"{line}; echo $OMP_NUM_THREADS"], capture_output=True, text=True,
                             env={"SLURM_CPUS_ON_NODE": on_node, "PATH": os.environ["PATH"]}).stdout.strip()
        assert got == want, (line, got)
