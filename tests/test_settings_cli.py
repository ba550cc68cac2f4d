"""`shardconsole settings`, the "did you mean" for other tools' names, `--version` and the torch check."""

from __future__ import annotations

import json
import os
import pytest

from conftest import shardconsole
from shardconsole.settings import config as C


def test_settings_json_lists_every_key_with_its_default_and_allowed_values():
    res = shardconsole("settings", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert list(doc) == ["model", "data", "train", "parallel", "precision", "fsdp", "deepspeed", "memory", "lora", "optim",
                         "preference", "grpo"]
    assert doc["fsdp"]["sharding"]["allowed"] == ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"]
    assert doc["train"]["grad_accum"] == {"default": 1, "optional": False, "type": "int", "min": 1,
                                          "help": "micro-batches per optimizer step"}
    assert doc["precision"]["reduce_dtype"]["default"] is None and doc["precision"]["reduce_dtype"]["optional"]
    assert doc["memory"]["gpu_memory_limit"]["type"] == "size"
    # Every listed default is a value the settings pipeline accepts for that key, and every key
    # `--set` accepts is listed (a renamed or added field shows up here without a list to update).
    for table, keys in doc.items():
        for key, d in keys.items():
            if d["default"] is not None and d["default"] != "":
                C.build(None, overrides=[f"{table}.{key}={json.dumps(d['default'])}"])
        with pytest.raises(C.ConfigError):
            C.build(None, overrides=[f"{table}.surely_not_a_key=1"])
    total = sum(len(v) for v in doc.values())
    text = shardconsole("settings").stdout
    assert len([ln for ln in text.splitlines() if ln.startswith("  ") and not ln.startswith("   ")]) == total
    assert "  micro_batch = 1    integer >= 1" in text


def test_settings_of_one_table_and_one_key_and_a_familiar_name():
    res = shardconsole("settings", "train.lr")
    assert res.returncode == 0 and res.stdout.startswith("[train]\n  lr = 0.0003    number >= 0.0\n")
    assert "peak learning rate" in res.stdout and "micro_batch" not in res.stdout
    res = shardconsole("settings", "learning_rate")
    assert res.returncode == 2 and "did you mean train.lr?" in res.stderr and len(res.stderr.splitlines()) == 1


@pytest.mark.parametrize("override, means", [
    ("train.gradient_accumulation_steps=4", "train.grad_accum"),
    ("train.per_device_train_batch_size=2", "train.micro_batch"),
    ("train.learning_rate=1e-4", "train.lr"),
    ("train.max_grad_norm=1", "train.clip_grad_norm"),
    ("deepspeed.gradient_clipping=1", "train.clip_grad_norm"),
    ("train.max_steps=10", "train.steps"),
    ("memory.gradient_checkpointing=true", "memory.activation_checkpointing"),
    ("data.max_seq_length=512", "data.seq_len"),
    ("train.seq_len=512", "data.seq_len"),          # a key of another table
])
def test_names_of_other_tools_get_did_you_mean_ours(override, means):
    with pytest.raises(C.ConfigError) as e:
        C.build(None, overrides=[override])
    assert f"(did you mean {means}?)" in str(e.value)


def test_familiar_names_in_a_preset_file_and_without_a_table(tmp_path):
    p = tmp_path / "hf.toml"
    p.write_text("learning_rate = 1e-4\n")
    with pytest.raises(C.ConfigError, match=r"'learning_rate' is a key outside any table \(did you mean train.lr\?\)"):
        C.load(p)
    res = shardconsole("--preset", "tiny-cpu", "--set", "gradient_accumulation_steps=4", "--print-command")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "shardconsole: error: --set 'gradient_accumulation_steps=4': expected table.key=value, e.g. "
        "train.steps=50 (did you mean train.grad_accum=4?)"]


def test_version_names_the_packages_that_decide_a_run():
    from importlib.metadata import version
    res = shardconsole("--version")
    assert res.returncode == 0
    assert res.stdout.startswith("shardconsole 0.1.0 (") and f"torch {version('torch')}" in res.stdout
    assert f"deepspeed {version('deepspeed')}" in res.stdout


def test_an_older_torch_is_refused_at_start_in_one_line(tmp_path):
    """A real installed-package record of torch 2.7.1 ahead on the path (what pip leaves for that
    release): the CLI refuses before anything is written."""
    info = tmp_path / "site" / "torch-2.7.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.7.1\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"), env=env)
    assert res.returncode == 2 and not (tmp_path / "run").exists()
    assert res.stderr.strip().splitlines() == [
        "shardconsole: error: torch 2.7.1 is installed; shardconsole needs torch >= 2.8 (its FSDP2 offload "
        "path uses FSDP2 internals of that release): pip install 'torch>=2.8'"]
    (info.parent / "torch-2.7.1.dist-info").rename(info.parent / "torch-2.8.0.dist-info")
    (info.parent / "torch-2.8.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.8.0+cu128\n")
    res = shardconsole("settings", "train.lr", env=env)
    assert res.returncode == 0, res.stderr


def test_several_nodes_without_a_rendezvous_blames_the_override_and_names_slurm(tmp_path):
    res = shardconsole("--preset", "4090x2-zero3", "--set", "parallel.nnodes=4", "--print-command",
                       "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 2 and not (tmp_path / "run").exists()
    assert res.stderr.strip().splitlines() == [
        "shardconsole: error: --set parallel.nnodes: nnodes = 4 needs the host:port of node 0: set "
        "parallel.rdzv_endpoint (e.g. \"node0:29400\"), or use --slurm, whose script takes the job's first node"]


def test_slurm_for_several_nodes_needs_no_rendezvous_and_prints_absolute_paths(tmp_path):
    """README's `--set parallel.nnodes=4 --slurm`: the script takes the job's first node (it exited 2)."""
    res = shardconsole("--preset", "4090x2-zero3", "--set", "parallel.nnodes=4", "--slurm",
                       "--run-dir", "rel-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert '--rdzv-endpoint="$head_node:' in res.stdout and "#SBATCH --nodes=4" in res.stdout
    assert f"--run-dir {tmp_path / 'rel-run'} " in res.stdout
    res = shardconsole("--preset", "4090x2-zero3", "--set", "parallel.nnodes=2", "--set",
                       "parallel.rdzv_endpoint=node0:29400", "--print-command", "--run-dir", "rel-run2", cwd=tmp_path)
    assert res.returncode == 0 and f"--run-dir {tmp_path / 'rel-run2'} " in res.stdout, res.stderr


def test_settings_of_a_preset_show_its_values_beside_the_defaults():
    res = shardconsole("settings", "train", "--preset", "4090x2-zero3", "--set", "train.steps=7")
    assert res.returncode == 0, res.stderr
    assert "  steps = 7  (default 20)    integer >= 1\n" in res.stdout
    assert "  lr = 6e-05  (default 0.0003)    number >= 0.0\n" in res.stdout       # the preset's own lr
    assert "  grad_accum = 1    integer >= 1\n" in res.stdout                     # same as the default
    doc = json.loads(shardconsole("settings", "deepspeed.stage", "--preset", "4090x2-zero3", "--json").stdout)
    assert doc == {"deepspeed": {"stage": {"default": 3, "optional": False, "type": "int", "min": 0, "max": 3,
                                           "help": "ZeRO stage: 0 none, 1 optimizer, 2 +gradients, 3 +parameters",
                                           "value": 3}}}
