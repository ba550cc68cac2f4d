"""A rank reads its environment once, into backends/rank/knobs.Knobs: no other module of the ranks reads a
variable (a knob is found in one place, and its value is the one the rank started with)."""

from __future__ import annotations

import re
from pathlib import Path

from shardconsole.backends.observe.failures import classify
from shardconsole.backends.rank.errors import Stopped
from shardconsole.backends.rank.knobs import Knobs

BACKENDS = Path(__file__).resolve().parents[1] / "shardconsole" / "backends"
# a read: os.environ.get(...), os.getenv(...), os.environ[...] not assigned to, envvars' read("...")
READ = re.compile(r"environ\.get\(|getenv\(|environ\[[^\]]+\](?!\s*=[^=])|(?<![\w.])read\(\s*[\"A-Z]")
# jit_cache.extension_dir is doctor's too (a front end, no Knobs): it asks envvars' checked reader
ALLOWED = {"rank/knobs.py", "rank/jit_cache.py"}


def test_no_module_of_the_ranks_reads_the_environment_but_knobs():
    found = [f"{p.relative_to(BACKENDS)}:{n}: {line.strip()}" for p in BACKENDS.rglob("*.py")
             if str(p.relative_to(BACKENDS)) not in ALLOWED
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if READ.search(line.split("#")[0])]
    assert found == [], found


def test_slurm_job_comes_from_the_knobs():
    """A stopped rank of a Slurm job says how Slurm continues it; elsewhere `resume` does."""
    assert "sbatch" in classify(Stopped("stop"), Knobs.from_env({"SLURM_JOB_ID": "42"}))[1]
    assert "sbatch" not in classify(Stopped("stop"), Knobs.from_env({}))[1]


def test_the_cuda_arch_list_is_a_knob():
    assert Knobs.from_env({"TORCH_CUDA_ARCH_LIST": "8.0;9.0a"}).cuda_arch_list == "8.0;9.0a"
    assert Knobs.from_env({}).cuda_arch_list == ""
