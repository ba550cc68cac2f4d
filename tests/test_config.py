"""Settings: defaults < preset < --set, save/load round-trip, and every validation error."""

from __future__ import annotations

import pytest

from shardconsole.settings import config as C
from shardconsole.settings import preset_store, resolve as settings
from tests.conftest import in_terminal, shardconsole


def test_every_builtin_preset_loads_and_round_trips(tmp_path):
    infos = preset_store.list_presets()
    names = {i.name for i in infos}
    assert {"tiny-cpu", "3090-offload", "3090-fsdp", "4090x2-zero3", "ddp-baseline", "h200-fsdp"} <= names
    for info in infos:
        cfg = C.load(info.path)
        assert info.description, f"{info.name} has no description"
        out = C.save(cfg, tmp_path / f"{info.name}.toml")
        again = C.load(out)
        assert again == cfg
        assert C.dumps(again) == C.dumps(cfg)


def test_precedence_set_over_preset_over_defaults(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('[train]\nsteps = 7\nlr = 0.5\n[fsdp]\ncpu_offload = true\n')
    cfg = C.load(p, ["train.steps=50", "fsdp.cpu_offload=false"])
    assert cfg.train.steps == 50            # --set wins
    assert cfg.train.lr == 0.5              # preset wins over the default
    assert cfg.fsdp.cpu_offload is False
    assert cfg.train.micro_batch == C.TrainSettings().micro_batch   # default


def test_set_values_are_typed_by_the_field():
    cfg = C.build({}, "x", ["model.name=1b", "train.lr=1e-4", "memory.gpu_memory_limit=24GiB",
                            "parallel.rdzv_endpoint=host:29400", "parallel.nnodes=2",
                            "deepspeed.reduce_bucket_size=5e8", "precision.dtype=fp16",
                            "precision.loss_scale_window=100"])
    assert cfg.model.name == "1b" and cfg.train.lr == 1e-4
    assert cfg.gpu_memory_limit_bytes == 24 * 2**30
    assert cfg.parallel.rdzv_endpoint == "host:29400"
    assert cfg.deepspeed.reduce_bucket_size == 500_000_000
    assert cfg.precision.loss_scale_window == 100


@pytest.mark.parametrize("doc, overrides, fragments", [
    ('[trian]\nsteps = 3\n', [], ["[trian]", "did you mean 'train'"]),
    ('[train]\nstep = 3\n', [], ["[train]", "'step'", "did you mean 'steps'"]),
    ('[train]\nsteps = "many"\n', [], ["[train] steps", "expected an integer"]),
    ('[train]\nsteps = 0\n', [], ["[train] steps", "below the minimum 1"]),
    ('[train]\nlr = true\n', [], ["[train] lr", "expected a number"]),
    ('[fsdp]\nsharding = "full_shrad"\n', [], ["[fsdp] sharding", "did you mean 'full_shard'"]),
    ('[precision]\ndtype = "bf16"\nloss_scale_window = 100\n', [], ["[precision] loss_scale_window", "fp16"]),
    ('[fsdp]\nsharding = "no_shard"\ncpu_offload = true\n', [], ["[fsdp] cpu_offload", "no_shard"]),
    ('[parallel]\nnnodes = 2\n', [], ["[parallel] rdzv_endpoint", "host:port"]),
    ('[memory]\ngpu_memory_limit = "24 bananas"\n', [], ["[memory] gpu_memory_limit", "24GiB"]),
    ('[deepspeed]\nstage = 2\noffload_param = "cpu"\n[parallel]\nbackend = "deepspeed"\n', [],
     ["[deepspeed] offload_param", "stage = 3"]),
    ('[deepspeed]\noffload_optimizer = "nvme"\n[parallel]\nbackend = "deepspeed"\n', [],
     ["[deepspeed] nvme_path"]),
    ('[data]\nsource = "text"\n', [], ["[data] path"]),
    ('', ["train.steps=abc"], ["--set train.steps", "expected an integer"]),
    ('', ["trian.steps=3"], ["did you mean 'train'"]),
    ('', ["train.stepz=3"], ["did you mean 'steps'"]),
    ('', ["steps=3"], ["table.key=value"]),
    ('color = "red"\n', [], ["'color' is a key outside any table"]),
])
def test_errors_name_file_table_key_and_what_is_allowed(tmp_path, doc, overrides, fragments):
    p = tmp_path / "bad.toml"
    p.write_text(doc)
    with pytest.raises(C.ConfigError) as e:
        C.load(p, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    if not overrides:
        assert str(p) in msg
    for frag in fragments:
        assert frag in msg, msg


def test_more_ranks_than_gpus_is_an_error():
    cfg = C.build({"parallel": {"nproc_per_node": 4}}, "p.toml")
    with pytest.raises(C.ConfigError, match=r"nproc_per_node: 4 ranks but this machine has 2 GPU"):
        C.validate(cfg, "p.toml", gpu_count=2)
    C.validate(C.build({"parallel": {"nproc_per_node": 4, "device": "cpu"}}, "p.toml"), gpu_count=2)


def test_invalid_toml_and_missing_file(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("[train\nsteps = 3")
    with pytest.raises(C.ConfigError, match="not valid TOML"):
        C.load(p)
    with pytest.raises(C.ConfigError, match="no such file"):
        C.load(tmp_path / "nope.toml")
    b = tmp_path / "bin.toml"
    b.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(C.ConfigError):
        C.load(b)


def test_sizes():
    assert C.parse_size("24GiB") == 24 * 2**30
    assert C.parse_size("512 MB") == 512 * 10**6
    assert C.parse_size("1.5e9") == 1_500_000_000
    assert C.parse_size(1024) == 1024
    for bad in ("", "GiB", "12 parsecs", "-1GiB"):
        with pytest.raises(ValueError):
            C.parse_size(bad)


def test_save_is_atomic_and_never_leaves_half_a_file(tmp_path, monkeypatch):
    target = tmp_path / "keep.toml"
    target.write_text('[train]\nsteps = 3\n')

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(C.os, "fsync", boom)
    with pytest.raises(OSError):
        C.save(C.RunConfig(), target)
    assert target.read_text() == '[train]\nsteps = 3\n'
    assert [p.name for p in tmp_path.iterdir()] == ["keep.toml"]


def test_user_preset_shadows_and_is_listed(_user_presets):
    cfg = preset_store.load("tiny-cpu")
    cfg.description = "my tuned tiny run"
    cfg.train.steps = 3
    path = preset_store.save_user_preset(cfg, "mine")
    assert path.parent == _user_presets
    with pytest.raises(FileExistsError):
        preset_store.save_user_preset(cfg, "mine")
    names = {i.name: i for i in preset_store.list_presets()}
    assert names["mine"].origin == "user" and names["mine"].description == "my tuned tiny run"
    assert preset_store.load("mine").train.steps == 3


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('[fsdp]\nshardng = "full_shard"\n')
    for args in (["--preset", str(p), "--headless"],
                 ["--preset", "tiny-cpu", "--set", "train.steps=-3", "--headless"],
                 ["--preset", "no-such-preset", "--headless"],
                 ["--preset", "tiny-cpu", "--set", "model.name=/no/such/dir", "--headless"]):
        res = shardconsole(*args, "--run-dir", str(tmp_path / "run"), timeout=60)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        assert "Traceback" not in res.stderr
        assert not (tmp_path / "run").exists()
    assert "did you mean 'sharding'" in shardconsole("--preset", str(p), "--headless").stderr


def test_cli_presets_lists_builtins_with_descriptions():
    res = shardconsole("presets", timeout=60)
    assert res.returncode == 0
    lines = {line.split()[0]: line for line in res.stdout.splitlines() if line.strip()}
    assert "built-in" in lines["3090-offload"] and "offload" in lines["3090-offload"].lower()
    assert "tiny-cpu" in lines


def test_cli_refuses_a_binary_data_file_before_launch(tmp_path):
    data = tmp_path / "weights.txt"
    data.write_bytes(bytes(range(256)) * 64)
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"),
                       "--set", "data.source=text", "--set", f"data.path={data}", timeout=60)
    assert res.returncode == 2 and "not a text file" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_cli_refuses_a_run_the_host_cannot_hold(tmp_path):
    """13B with fp32 masters fully offloaded needs ~264 GiB of host RAM: refused before anything starts
    (a host OOM takes down more than the run), with the planner's figure; --force overrides."""
    res = shardconsole("--preset", "3090-offload", "--headless", "--run-dir", str(tmp_path / "run"),
                       "--set", "model.name=13b", timeout=60)
    assert res.returncode == 2, res.stderr
    err = [line for line in res.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and "of host RAM, over the" in err[0] and "--force" in err[0]
    assert not (tmp_path / "run").exists()


def test_optional_keys_can_be_unset_from_the_command_line():
    cfg = C.build({"precision": {"reduce_dtype": "bf16"}}, "p.toml", ["precision.reduce_dtype=none"])
    assert cfg.precision.reduce_dtype is None
    assert "reduce_dtype" not in C.dumps(cfg)


# ---------------------------------------------------------------------------------------------------
# Errors name the source the value came from (issue 14 item 2), and what TOML and the file system allow
# (issue 22 item 14). Real CLI subprocesses: exit 2, one line, no traceback, nothing written.

@pytest.mark.parametrize("sets, line", [
    (["memory.gpu_memory_limit=24XB"],
     "--set memory.gpu_memory_limit: '24XB' is not a size: use a number with a unit such as 24GiB, 512MiB, 2GB"),
    (["fsdp.sharding=full_shrad"],
     "--set fsdp.sharding: 'full_shrad' is not allowed; expected one of 'full_shard', 'shard_grad_op', 'no_shard', "
     "'hybrid_shard' (did you mean 'full_shard'?); what is sharded: params+grads+optimizer, grads+optimizer, "
     "nothing, or full within a node"),
    (["train.stepz=3"], "--set train.stepz: unknown key 'stepz' (did you mean 'steps'?); keys are "),
    # A check across keys blames the source of the key it names: here the override, not the preset.
    (["fsdp.sharding=no_shard", "fsdp.cpu_offload=true"],
     "--set fsdp.cpu_offload: needs sharded parameters; with sharding = \"no_shard\" nothing is offloaded: use "
     "full_shard or shard_grad_op"),
    (["train.steps=99999999999999999999"],
     "--set train.steps: 99999999999999999999 is out of range; TOML integers are 64-bit (at most "
     "9223372036854775807); optimizer steps to run"),
])
def test_cli_set_errors_name_the_override(tmp_path, sets, line):
    args = [a for s in sets for a in ("--set", s)]
    res = shardconsole("--preset", "tiny-cpu", *args, "--headless", "--run-dir", str(tmp_path / "run"), timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"shardconsole: error: {line}"), res.stderr
    assert "tiny-cpu.toml" not in res.stderr
    assert not (tmp_path / "run").exists()


def test_a_cross_key_check_blames_the_preset_for_the_presets_key(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('[fsdp]\ncpu_offload = true\n')
    with pytest.raises(C.ConfigError) as e:
        settings.resolve(str(p), ["fsdp.sharding=no_shard"])
    assert (e.value.source, e.value.table, e.value.key) == (str(p), "fsdp", "cpu_offload")
    assert str(e.value).startswith(f"{p}: [fsdp] cpu_offload: needs sharded parameters")


def test_the_largest_toml_integer_is_taken_and_one_more_is_not():
    assert settings.resolve("tiny-cpu", [f"train.steps={2**63 - 1}"]).cfg.train.steps == 2**63 - 1
    with pytest.raises(C.ConfigError, match="out of range; TOML integers are 64-bit"):
        settings.resolve("tiny-cpu", [f"train.steps={2**63}"])
    with pytest.raises(C.ConfigError, match=r"^p.toml: \[train\] seed: .* out of range"):
        C.build({"train": {"seed": 2**64}}, "p.toml")


@pytest.mark.parametrize("name", ["my.toml", "-x", "my\nname", "x" * 300, "my tiny", "myreset!", "", ".hidden"])
def test_preset_names_outside_the_rule_are_refused(_user_presets, name):
    with pytest.raises(C.ConfigError) as e:
        preset_store.save_user_preset(C.RunConfig(), name)
    assert "\n" not in str(e.value) and "letters, digits, '-' and '_'" in str(e.value)
    assert list(_user_presets.iterdir()) == []


def test_a_preset_cannot_take_a_builtins_name(_user_presets):
    with pytest.raises(C.ConfigError, match="'tiny-cpu' is a built-in preset; pick another name"):
        preset_store.save_user_preset(C.RunConfig(), "tiny-cpu")
    assert list(_user_presets.iterdir()) == []
    assert preset_store.save_user_preset(C.RunConfig(), "Tiny_2-b").name == "Tiny_2-b.toml"


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from tests.hf_fixtures import make_hf_model
    return make_hf_model(tmp_path_factory.mktemp("hf") / "llama")


@pytest.mark.parametrize("change, words", [
    ({"auto_map": {"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}}, "needs its own code (auto_map)"),
    ({"model_type": "mine"}, "model_type 'mine' is not a causal language model that this transformers builds"),
])
def test_cli_refuses_a_model_transformers_cannot_build_up_front(tmp_path, hf_model, change, words):
    import json
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(hf_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    res = shardconsole("--preset", "tiny-cpu", "--set", f"model.name={folder}", "--headless",
                       "--run-dir", str(tmp_path / "run"), timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardconsole: error: --set model.name: ") and words in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_consoles_lenient_resolution_sets_each_bad_override_aside_and_blames_the_field():
    """The console resolves through the same pipeline, leniently: every refused field comes back with its
    own error (not only the first), and an impossible combination names the field that set its key."""
    fields = [settings.from_console("train", "steps", "0"), settings.from_console("train", "lr", "fast"),
              settings.from_console("fsdp", "sharding", "no_shard"), settings.from_console("fsdp", "cpu_offload", "true")]
    r = settings.resolve("tiny-cpu", fields, lenient=True)
    assert sorted(r.refused) == ["train.lr", "train.steps"]
    assert str(r.refused["train.lr"]) == "console: [train] lr: expected a number, got 'fast'; peak learning rate"
    assert r.cfg.train.steps == settings.resolve("tiny-cpu").cfg.train.steps     # set aside, not half-applied
    assert (r.invalid.source, r.invalid.path) == ("console: [fsdp] cpu_offload", "fsdp.cpu_offload")
    assert [e.path for e in r.problems] == ["train.steps", "train.lr", "fsdp.cpu_offload"]
    with pytest.raises(C.ConfigError, match=r"^console: \[train\] steps: 0 is below the minimum 1"):
        settings.resolve("tiny-cpu", fields)          # strict (every other front end): the first error


def test_cli_presets_on_an_80_column_terminal_wraps_each_description_under_its_column():
    lines = [line for line in in_terminal("presets") if line]
    assert lines and all(len(line) <= 80 for line in lines), max(lines, key=len)
    piped = shardconsole("presets", timeout=60).stdout.splitlines()     # one line a preset, as it was
    starts = [i for i, line in enumerate(lines) if line[:1].strip()]
    assert [lines[i].split()[0] for i in starts] == [line.split()[0] for line in piped]
    for k, i in enumerate(starts):     # the wrapped lines put back together are the piped line's description
        block = lines[i:starts[k + 1] if k + 1 < len(starts) else len(lines)]
        assert " ".join(" ".join(block).split()) == " ".join(piped[k].split()), block
        column = block[0].index("built-in") + len("built-in  ")      # where the descriptions start
        assert all(line[:column].isspace() and line[column] != " " for line in block[1:]), block


@pytest.mark.parametrize("argv", [("plan", "--preset", "3090-7b-offload", "--card", "rtx3090"),
                                  ("plan", "--fit", "--card", "rtx3090", "--host-memory", "64GiB"), ("doctor",)])
def test_reports_on_an_80_column_terminal_wrap_between_words_and_say_the_same_piped(argv):
    res = shardconsole(*argv, timeout=120)
    shown = in_terminal(*argv, rc=res.returncode)      # plan exits 3 where it does not fit, on both
    assert all(len(line) <= 80 for line in shown), max(shown, key=len)
    piped = res.stdout
    assert max(len(line) for line in piped.splitlines()) > 80      # piped, a fact stays one line
    words = " ".join(shown).split()
    if argv[0] == "plan":       # the same words, in order (doctor's measure a GPU box anew each time)
        assert words == piped.split()
    else:
        assert words[:12] == piped.split()[:12]
