"""Planning the host side for a host other than this one (issue 63): `plan --host-cores N --host-gbps X`
and `tune`'s ranking with them. The offloaded optimizer step runs on the host's cores at its memory
bandwidth: a 2-core laptop planning the 16-core H200 box must be able to say so."""

from __future__ import annotations

import json

import pytest

from conftest import shardconsole
from shardconsole.cli import main as cli
from shardconsole.settings import resolve as settings
from shardconsole import plan as PL

GiB = 2**30
# 7B, fp32 masters, FSDP2 offload: the run issue 63 measured at 7,889 tokens/s on the H200's 16-core host
SEVEN_B = ("--preset", "3090-7b-offload", "--set", "precision.master_dtype=fp32", "--card", "h200",
           "--host-memory", "256GiB")


def _plan_json(*args: str) -> dict:
    res = shardconsole("plan", *SEVEN_B, "--json", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_more_host_cores_plan_a_faster_offloaded_step_and_the_report_names_them():
    two = shardconsole("plan", *SEVEN_B, "--host-cores", "2")
    sixteen = shardconsole("plan", *SEVEN_B, "--host-cores", "16")
    assert two.returncode == sixteen.returncode == 0, two.stderr + sixteen.stderr

    def rate(out: str) -> float:
        line = next(ln for ln in out.splitlines() if ln.startswith("speed (predicted"))
        return float(line.split("): ")[1].split(" tokens/s")[0].replace(",", ""))
    slow, fast = rate(two.stdout), rate(sixteen.stdout)
    assert fast > 3 * slow, (slow, fast)        # the host step was the bound at 2 cores, not at 16
    assert "16 CPU cores" in sixteen.stdout and "--host-cores 16" in sixteen.stdout
    assert "host step at 118 GB/s, 16 cores" in sixteen.stdout
    assert "host step at 15 GB/s, 2 cores" in two.stdout


def test_json_carries_the_host_given():
    d = _plan_json("--host-cores", "16", "--host-gbps", "90")
    assert d["hardware"]["host_cores"] == 16 and d["hardware"]["host_gbps"] == 90
    assert d["host"] == {"cores": 16, "gbps": 90, "source": "--host-gbps"}
    slower = _plan_json("--host-cores", "16", "--host-gbps", "30")
    assert slower["predicted_tokens_per_s"] < d["predicted_tokens_per_s"]
    assert slower["parts_s"]["host step"] == pytest.approx(3 * d["parts_s"]["host step"], rel=1e-2)


def test_the_flag_wins_over_the_environment():
    d = json.loads(shardconsole("plan", *SEVEN_B, "--json", "--host-gbps", "100",
                                env={"SHARDCONSOLE_HOST_GBPS": "10"}).stdout)
    assert d["host"]["gbps"] == 100 and d["host"]["source"] == "--host-gbps"
    d = json.loads(shardconsole("plan", *SEVEN_B, "--json", env={"SHARDCONSOLE_HOST_GBPS": "10"}).stdout)
    assert d["host"]["gbps"] == 10 and d["host"]["source"] == "SHARDCONSOLE_HOST_GBPS"


def test_fit_plans_the_host_given(capsys):
    assert cli.main(["plan", "--fit", "--json", "--card", "h200", "--host-memory", "256GiB", "--host-cores", "8",
                     "--host-gbps", "40"]) == 0
    hw = json.loads(capsys.readouterr().out)["hardware"]
    assert hw["host_cores"] == 8 and hw["host_gbps"] == 40


@pytest.mark.parametrize("flag", ["--host-cores", "--host-gbps"])
@pytest.mark.parametrize("value", ["0", "-4", "nan", "abc", "1e400", "inf"])
@pytest.mark.parametrize("command", [["plan", "--preset", "3090-offload"], ["plan", "--fit"],
                                     ["tune", "--preset", "3090-offload", "--dry-run"]])
def test_bad_host_values_are_one_line_and_exit_2(command, flag, value, capsys):
    assert cli.main([*command, f"{flag}={value}"]) == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"shardconsole: error: {flag}: ") and not out.out


def test_tune_ranks_with_the_host_given():
    """tune's ranking is the speed model's on an H200: the offloaded options' host step follows the cores
    given, and the dry run's first line names them."""
    from shardconsole.tune.setup import make_tune
    h200 = PL.Hardware(gpus=1, gpu_memory_bytes=24 * GiB, host_memory_bytes=256 * GiB, gpu_name="NVIDIA H200",
                       cpus=2)
    r = settings.resolve("3090-7b-offload", settings.from_cli(["precision.master_dtype=fp32",
                                                               "fsdp.cpu_offload=true"]))

    def offload_rate(cores: str | None) -> float:
        tune = make_tune(r, budget_s=60, max_probes=1, probe_steps=2, hardware=h200, host_cores=cores,
                         dry_run=True)
        tune.plan()
        base = next(o for o in tune.options if o.baseline)
        assert base.prediction.unit == "tokens/s"
        return base.prediction.value
    assert offload_rate("16") > 3 * offload_rate(None)
    res = shardconsole("tune", "--preset", "3090-7b-offload", "--dry-run", "--host-cores", "16", "--host-gbps", "90")
    assert res.returncode == 0, res.stderr
    assert "16 CPU cores (--host-cores 16 --host-gbps 90)" in res.stdout.splitlines()[0]
