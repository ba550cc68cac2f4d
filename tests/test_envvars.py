"""Every environment variable shardconsole reads goes through one checked reader (shardconsole/envvars.py),
which docs/ENVIRONMENT.md documents, and a value it cannot use is one line before anything starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardconsole import envvars
from tests.conftest import shardconsole

REPO = Path(__file__).resolve().parent.parent


def test_the_documented_variables_are_the_readers():
    doc = (REPO / "docs" / "ENVIRONMENT.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)", doc, re.M))
    documented |= {n for row in re.findall(r"^\| (`[A-Z][^|]*)\|", doc, re.M)
                   for n in re.findall(r"`([A-Z][A-Z0-9_]+)", row)}
    assert documented == set(envvars.VARS)


def test_no_module_reads_a_variable_of_ours_behind_the_reader():
    # os.environ["X"] = ... is a write (the DeepSpeed rank sets DS_ACCELERATOR and mends TORCH_CUDA_ARCH_LIST)
    read = re.compile(r'(?:environ(?:\.get)?\(|environ\[|getenv\()\s*"([A-Z][A-Z0-9_]+)"(?!\]\s*=[^=])')
    stray = [f"{p.relative_to(REPO)}: {m}" for p in (REPO / "shardconsole").rglob("*.py")
             if p.name != "envvars.py" for m in read.findall(p.read_text()) if m in envvars.VARS]
    assert stray == [], stray


@pytest.mark.parametrize("name, value", [
    ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "abc"),      # torchrun's traceback
    ("SHARDCONSOLE_FAULT", "oom@rank=x"),           # a rank's raw ValueError
    ("SHARDCONSOLE_FAULT", "explode@step=2"),
    ("SHARDCONSOLE_HOST_GBPS", "abc"),              # silently the default
    ("SHARDCONSOLE_HOST_GBPS", "nan"),
    ("SHARDCONSOLE_FP8_EMULATE", "yes"),            # silently off
    ("SHARDCONSOLE_CACHE_DIR", "/dev/null"),        # a rank's crash writing its token cache
    ("SHARDCONSOLE_OVERLAP_NICE", "99"),
    ("SHARDCONSOLE_PROFILE", "5-2"),
    ("OMP_NUM_THREADS", "0"),
])
def test_a_bad_value_is_refused_before_launch_in_one_line(tmp_path, name, value):
    run = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=2",
                       env={name: value})
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"environment variable {name}={value!r}: expected " in lines[0], res.stderr
    assert not run.exists()


@pytest.mark.parametrize("argv", [("plan", "--preset", "tiny-cpu"), ("tune", "--dry-run", "--preset", "tiny-cpu")])
def test_the_planner_refuses_a_host_rate_it_cannot_read(argv):
    res = shardconsole(*argv, env={"SHARDCONSOLE_HOST_GBPS": "fast"})
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "shardconsole: error: environment variable SHARDCONSOLE_HOST_GBPS='fast': expected a number of GB/s above 0"]


def test_good_values_pass_and_read_typed():
    good = {"OMP_NUM_THREADS": "4,2", "SHARDCONSOLE_FAULT": "pace@rank=0,ms=200; nan@step=3",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": " 45 ", "WANDB_MODE": "online", "SHARDCONSOLE_PROFILE": "7",
            "SHARDCONSOLE_HOST_GBPS": "118", "SHARDCONSOLE_FP8_EMULATE": "1", "SHARDCONSOLE_STREAM": "off"}
    envvars.check(good)
    assert envvars.read("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", good) == 45
    assert envvars.read("SHARDCONSOLE_HOST_GBPS", good) == 118.0 and envvars.read("SHARDCONSOLE_FP8_EMULATE", good)
    assert envvars.read("SHARDCONSOLE_PROFILE", good) == (7, 7) and envvars.read("SHARDCONSOLE_HOST_GBPS", {}) is None


def test_a_cache_folder_that_cannot_be_made_is_refused_before_a_run_on_records(tmp_path):
    # the ranks' token cache: rank 0 failed with FileNotFoundError: '/proc/x'
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"text": "record {i} of some text"}}\n' for i in range(8)))
    run = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=2",
                       "--set", f"data.path={data}", "--set", "data.tokenizer=bytes",
                       env={"SHARDCONSOLE_CACHE_DIR": "/proc/x"})
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith("shardconsole: error: environment variable SHARDCONSOLE_CACHE_DIR='/proc/x': "), lines
    assert not run.exists()
