"""Launch argv for one node and several, with no shell anywhere."""

from __future__ import annotations

import sys
from pathlib import Path

from shardconsole import config as C
from shardconsole.launch import build_argv, new_run_dir
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
    assert not (tmp_path / "r").exists()
    res = shardconsole("--preset", "tiny-cpu", "--print-command", "--set", "parallel.nnodes=2",
                       "--set", "parallel.rdzv_endpoint=host:29400", timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--rdzv-endpoint=host:29400" in res.stdout and "--nnodes=2" in res.stdout
    assert sys.executable in res.stdout
