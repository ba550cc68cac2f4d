"""Launch argv for one node and several, with no shell anywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shardconsole import config as C
from shardconsole.launch import build_argv, new_run_dir, slurm_script
from tests.conftest import shardconsole


def test_single_node_torchrun():
    cfg = C.build({"parallel": {"nproc_per_node": 2}})
    argv = build_argv(cfg, Path("runs/x"), "x", python="py")
    assert argv[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in argv and "--nnodes=1" in argv and "--standalone" in argv
    assert argv[-6:] == ["-m", "shardconsole.backends", "--run-dir", "runs/x", "--run-id", "x"]


def test_fixed_port():
    argv = build_argv(C.build({"parallel": {"master_port": 29511}}), Path("r"), "r", python="py")
    assert "--master-port=29511" in argv and "--standalone" not in argv


def test_multi_node_rendezvous():
    cfg = C.build({}, overrides=["parallel.nnodes=2", "parallel.rdzv_endpoint=host:29400",
                                 "parallel.nproc_per_node=8"])
    argv = build_argv(cfg, Path("r"), "run7", python="py")
    assert "--nnodes=2" in argv and "--nproc-per-node=8" in argv
    assert "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=host:29400" in argv
    assert "--rdzv-id=run7" in argv and "--standalone" not in argv
    cfg.parallel.node_rank = 1
    assert "--node-rank=1" in build_argv(cfg, Path("r"), "run7", python="py")


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
    assert "torch.distributed.run" in res.stdout and "--nproc-per-node=2" in res.stdout
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
    assert {"#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"} <= set(lines)
    srun = next(line for line in lines if line.startswith("srun "))
    # one torchrun agent a node (even for a DeepSpeed run: no hostfile, no ssh), rendezvous on the first node
    assert "/opt/py -m torch.distributed.run --nproc-per-node=8" in srun
    assert '--rdzv-endpoint="$head_node:29500"' in srun and '--rdzv-id="$SLURM_JOB_ID"' in srun
    assert f"--run-dir '{tmp_path / 'run dir'}'" in srun          # quoted: the path has a space
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    # CPU ranks: no GPUs asked of Slurm, and the ranks told not to take one; a port per job
    cpu = slurm_script(C.build({}, overrides=["parallel.device=cpu"]), tmp_path, "x", python="py")
    assert "--gpus-per-node" not in cpu and "export CUDA_VISIBLE_DEVICES=''" in cpu
    assert "SLURM_JOB_ID % 20000" in cpu
