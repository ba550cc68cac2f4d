"""`shardconsole doctor` on this machine (no GPU: it says what it can), and a launch on a machine whose
saved doctor verdict says P2P is broken."""

from __future__ import annotations

import json
import resource
import socket
from importlib.metadata import version

import pytest

from shardconsole.doctor import checks as doctor
from shardconsole.machine import doctor_verdict
from shardconsole.launch import command as launch_command
from shardconsole.settings import resolve as settings
from tests.conftest import shardconsole


@pytest.fixture(scope="module")
def report():
    res = shardconsole("doctor", "--json", timeout=240)
    assert res.returncode in (0, 1), res.stderr
    return res, json.loads(res.stdout)


def test_doctor_reports_what_a_machine_without_gpu_can_tell(report):
    res, r = report
    assert r["gpus"] == [] and r["p2p"] == [] and r["allreduce"] == {}
    assert "NVML" in r["nvml"] or "driver" in r["nvml"]
    v = r["versions"]
    assert v["torch"] == version("torch") and v["deepspeed"] == version("deepspeed")
    assert v["driver"] is None and v["torch_cuda"] is None and v["nccl"] is None
    # memlock: this process's own limit, against the pinned bytes of every built-in preset that pins
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    mem = r["memlock"]
    assert mem["soft_bytes"] == (None if soft == resource.RLIM_INFINITY else soft)
    by = {p["preset"]: p for p in mem["presets"]}
    assert set(by) == {"3090-offload", "3090-7b-offload", "4090x2-zero3",          # the presets that pin
                       "3090-8b-64gb", "3090-14b-96gb", "3090-24b-128gb"}
    # 3090-offload: a 0.95B model's fp32 shards and gradients, pinned: at least 2 x 4 bytes a parameter
    assert by["3090-offload"]["pinned_per_rank_bytes"] >= 8 * 0.9e9
    for p in by.values():
        assert p["fits"] == (soft == resource.RLIM_INFINITY or p["pinned_per_rank_bytes"] <= soft)
    # no GPU: runs here pin nothing, so a limit under a preset's figure is said, not a problem (exit 0)
    assert mem["applies"] is False and r["problems"] == [] and res.returncode == 0
    ops = r["deepspeed_ops"]
    assert ops["FusedAdam"]["state"] == "not for this machine (a CUDA build of torch runs it)"
    assert ops["CPUAdam"]["state"] in ("pre-built", "JIT-built (cached)",
                                       "not built: compiles at the first run that needs it (a few minutes)")
    text = doctor.format_report(r)
    assert "GPUs: none (" in text and "no GPU checks (PCIe, P2P, all-reduce) on this machine" in text
    assert "no GPU here, so runs here pin nothing" in text and "problems: none" in text
    assert f"torch {version('torch')}" in text
    assert "CPUAdam (optimizer offload): " in text


def test_doctor_refuses_bad_input_in_one_line():
    res = shardconsole("doctor", "--preset", "3090-offload", "--set", "fsdp.pin_memory=maybe", timeout=120)
    assert res.returncode == 2
    assert res.stderr.startswith("shardconsole: error: --set fsdp.pin_memory: ") and "Traceback" not in res.stderr
    assert res.stdout == ""


def test_a_gpu_launch_disables_p2p_where_the_doctor_found_it_broken(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path))
    gpu = settings.resolve("3090-offload").cfg
    cpu = settings.resolve("tiny-cpu").cfg
    assert "NCCL_P2P_DISABLE" not in launch_command.launch_env(gpu, {})          # no verdict yet
    doctor_verdict.save_verdict(["GPU-a", "GPU-b"], True, "all-reduce with P2P: hung; without: ok")
    env = launch_command.launch_env(gpu, {})
    assert env["NCCL_P2P_DISABLE"] == "1"
    assert env[doctor_verdict.P2P_NOTE_ENV].startswith("NCCL_P2P_DISABLE=1 set for this run: `shardconsole doctor` "
                                                       "found peer-to-peer broken on this machine")
    assert "NCCL_P2P_DISABLE" not in launch_command.launch_env(cpu, {})          # gloo: nothing to disable
    assert launch_command.launch_env(gpu, {"NCCL_P2P_DISABLE": "0"})["NCCL_P2P_DISABLE"] == "0"  # the user's own
    # another machine's verdict (a shared home folder) is not this one's
    body = json.loads((tmp_path / doctor_verdict.VERDICT_FILE).read_text())
    (tmp_path / doctor_verdict.VERDICT_FILE).write_text(json.dumps({**body, "host": socket.gethostname() + "-other"}))
    assert "NCCL_P2P_DISABLE" not in launch_command.launch_env(gpu, {})
    doctor_verdict.save_verdict(["GPU-a", "GPU-b"], False, "ok")
    assert "NCCL_P2P_DISABLE" not in launch_command.launch_env(gpu, {})
