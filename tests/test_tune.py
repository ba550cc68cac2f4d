"""`shardconsole tune` (issue 16): real 2-rank CPU probes, a failing probe reported and skipped, the
winner written as a preset that then runs; the ranking by measured speeds (plan/speed/book.py), the same
ranking in `plan --fit` and the hint after a GPU OOM; bad input as one line."""

from __future__ import annotations

import json
import socket
import tomllib

import pytest

from conftest import messages, of_kind, shardconsole
from shardconsole.cli import main as cli
from shardconsole.settings import config as C
from shardconsole import plan as PL
from shardconsole.settings.models import resolve
from shardconsole.plan import search
from shardconsole.plan.speed.book import SpeedBook, record_of, signature
from shardconsole.user_folders import speeds_file
from shardconsole.cli import tune as tune_cli
from shardconsole.tune.report import HEADER_MARK, write_preset

GiB = 2**30
H200 = PL.Hardware(gpus=1, gpu_memory_bytes=143771 * 2**20, host_memory_bytes=125 * GiB, gpu_name="NVIDIA H200")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One real tune of tiny-cpu: two probes of 3 steps on 2 CPU ranks. The settings as given (probed
    first) are made unable to start: a port this test holds is their rendezvous port, so the launch
    refuses them (session/rundir.check_port_free) before any process starts."""
    mp = pytest.MonkeyPatch()
    base = tmp_path_factory.mktemp("tune")
    mp.setenv("SHARDCONSOLE_PRESETS_DIR", str(base / "presets"))
    mp.setenv("SHARDCONSOLE_SPEEDS_FILE", str(base / "speeds.jsonl"))
    mp.setenv("SHARDCONSOLE_RUNS_ROOT", str(base / "runs"))
    args = tune_cli._parser().parse_args(["--preset", "tiny-cpu", "--max-probes", "2", "--probe-steps", "3",
                                          "--budget", "150s", "-o", "tiny-tuned"])
    tune, source, name = tune_cli.setup(args)
    tune.plan()
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    baseline = next(o for o in tune.options if o.baseline)
    baseline.cfg = PL.replace_cfg(baseline.cfg, ("parallel", "master_port", held.getsockname()[1]))
    try:
        winner = tune.run()
    finally:
        held.close()
    path = write_preset(tune, winner, name, source) if winner else None
    yield {"tune": tune, "winner": winner, "path": path, "base": base, "name": name}
    mp.undo()


def test_a_failing_probe_is_reported_and_skipped_and_the_winner_is_measured(tuned):
    tune = tuned["tune"]
    first, second = tune.rows
    assert first.option.baseline and first.result.status == "cannot start"
    assert "already in use" in first.result.message
    assert second.result.ok, second.result.message
    assert second.result.steps == 3
    assert second.result.tokens_per_s > 0
    assert second.result.host_peak_bytes > 100 * 2**20        # two real ranks' RSS
    assert tuned["winner"] is second
    # the probe ran through the normal path: a run folder with the ranks' stream, ended, nothing left
    msgs = messages(tune.root / "probe-02")
    assert len(of_kind(msgs, "hello")) == 2 and of_kind(msgs, "finished")
    # what it measured is kept for the next ranking, under this machine and these settings
    book = SpeedBook.load(tuned["base"] / "speeds.jsonl")
    assert [r.tokens_per_s for r in book.records] == [second.result.tokens_per_s]
    assert book.predict(second.option.cfg, tune.hw).source == "measured"


def test_the_written_preset_holds_the_figures_and_runs(tuned, tmp_path):
    path, winner = tuned["path"], tuned["winner"]
    text = path.read_text()
    assert text.startswith(HEADER_MARK)
    assert f"{winner.result.tokens_per_s:.0f} tokens/s" in text.split("\n\n")[0]
    assert "cannot start" in text.split("\n\n")[0]                  # the failed probe is on record
    saved = C.build(tomllib.loads(text), str(path))
    for table, key, value in winner.option.changes:
        assert getattr(getattr(saved, table), key) == value
    assert saved.train.steps == 30 and saved.train.save_final == "full"     # the probe's settings are not saved
    run_dir = tmp_path / "run"
    r = shardconsole("--preset", tuned["name"], "--headless", "--set", "train.steps=1", "--run-dir", str(run_dir),
                     env={"SHARDCONSOLE_PRESETS_DIR": str(tuned["base"] / "presets")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert of_kind(messages(run_dir), "finished")


def test_a_second_tune_does_not_overwrite_a_preset_it_did_not_write(tuned, monkeypatch):
    monkeypatch.setenv("SHARDCONSOLE_PRESETS_DIR", str(tuned["base"] / "presets"))
    path = tuned["path"]
    other = path.with_name("mine.toml")
    other.write_text('description = "hand made"\n')
    with pytest.raises(C.ConfigError, match="not written by tune"):
        write_preset(tuned["tune"], tuned["winner"], "mine", "tiny-cpu")
    assert other.read_text() == 'description = "hand made"\n'
    write_preset(tuned["tune"], tuned["winner"], tuned["name"], "tiny-cpu")      # its own: replaced


def test_the_tune_keeps_the_numerics_unless_named(tuned):
    """Issue 34: master dtype, rounding and compute dtype change the update, so no option, no probe and
    not the winner changes them unless --vary names them."""
    tune = tuned["tune"]
    assert not tune.vary and tune.options
    for o in tune.options:
        assert search.numerics_changed(o.cfg, tune.base) == [], o.name
    assert search.numerics_changed(tuned["winner"].option.cfg, tune.base) == []
    saved = C.load(tuned["path"])
    assert (saved.precision.dtype, saved.precision.master_dtype) == (tune.base.precision.dtype, "fp32")
    # at bf16 compute the masters could be bf16 too: kept fp32 unless named
    bf16 = PL.replace_cfg(tune.base, ("precision", "dtype", "bf16"))
    kept = search.options(bf16, tune.spec, tune.hw, SpeedBook([]), fixed={"precision.dtype"})
    assert {o.cfg.precision.master_dtype for o in kept} == {"fp32"}
    masters = search.options(bf16, tune.spec, tune.hw, SpeedBook([]), vary={"precision.master_dtype"})
    assert {o.cfg.precision.master_dtype for o in masters} == {"fp32", "bf16"}
    # named, the key is searched: tiny-cpu's fp32 compute gets bf16 options (no fp16 on CPU ranks)
    named = search.options(tune.base, tune.spec, tune.hw, SpeedBook([]), vary={"precision.dtype"})
    assert {o.cfg.precision.dtype for o in named} == {"fp32", "bf16"}
    assert {o.cfg.precision.master_dtype for o in named} == {"fp32"}


def test_a_faster_numerics_change_is_one_line_under_the_table_and_not_probed(capsys, tmp_path):
    """This machine measured tiny-cpu at bf16 three times as fast (an earlier `--vary precision.dtype`
    tune, say): the tune keeps fp32 and says what bf16 would give, in one line, from the speed book."""
    from shardconsole.plan.machine import detect_hardware
    from shardconsole.settings import resolve as settings
    cfg, hw = settings.resolve("tiny-cpu").cfg, detect_hardware()
    book = SpeedBook.load()
    book.add(record_of(cfg, hw, 1000.0, "tune probe"))
    book.add(record_of(PL.replace_cfg(cfg, ("precision", "dtype", "bf16")), hw, 3000.0, "tune probe"))
    assert cli.main(["tune", "--preset", "tiny-cpu", "--dry-run", "--runs-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "changes the update" in line]
    assert len(notes) == 1, out
    assert notes[0].startswith("bf16 compute would give ~3.00k tokens/s, 3.0x") and "not probed" in notes[0]
    assert "--vary precision.dtype probes it" in notes[0]
    listed = [line for line in out.splitlines() if "tokens/s (" in line]
    assert listed and not any("bf16" in line for line in listed)          # listed, never as an option
    # asked for, it is an option (and the note has nothing left to say)
    assert cli.main(["tune", "--preset", "tiny-cpu", "--dry-run", "--vary", "precision.dtype",
                     "--runs-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bf16 compute" in out.splitlines()[2] and "changes the update" not in out


def test_the_output_name_is_checked_before_the_first_probe(_user_presets, _runs_root, capsys):
    """Issue 36.13: a preset tune may not replace is refused at once, not after the whole budget."""
    (_user_presets / "tiny-cpu-tuned.toml").write_text('description = "hand made"\n')
    assert cli.main(["tune", "--preset", "tiny-cpu", "--max-probes", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'tiny-cpu-tuned' exists and was not written by tune" in err, err
    assert not list(_runs_root.iterdir())                        # no probe folder: nothing launched
    assert (_user_presets / "tiny-cpu-tuned.toml").read_text() == 'description = "hand made"\n'


def test_finished_runs_under_the_runs_root_are_kept_once(tuned, tmp_path):
    """A finished run's speed joins the book the next time tune or plan looks (harvest), once."""
    import shutil

    from shardconsole.plan.speed.book import harvest
    root = tmp_path / "runs"
    shutil.copytree(tuned["tune"].root / "probe-02", root / "20261201-000000-tiny")
    book = SpeedBook([], tmp_path / "speeds.jsonl")
    hw = tuned["tune"].hw
    assert harvest(book, root, hw) == 1 and harvest(book, root, hw) == 0
    rec = SpeedBook.load(tmp_path / "speeds.jsonl").records
    assert len(rec) == 1 and rec[0].source == "run" and rec[0].signature == signature(tuned["winner"].option.cfg)
    assert rec[0].tokens_per_s == pytest.approx(tuned["winner"].result.tokens_per_s, rel=0.01)


# ---------------------------------------------------------------------------------------------------
# The ranking: measurements first, then the speed model, the fixed factors only where it cannot say

def _cfg(*sets: str) -> C.RunConfig:
    return C.build({"model": {"name": "1b"}, "data": {"seq_len": 2048}, "parallel": {"device": "cuda"},
                    "train": {"micro_batch": 4}}, "test", list(sets))


def test_measured_speeds_reorder_the_cold_start():
    fsdp_off = _cfg("fsdp.cpu_offload=true", "memory.activation_checkpointing=true")
    ds_off = _cfg("parallel.backend=deepspeed", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu",
                  "memory.activation_checkpointing=true")
    cold = SpeedBook([])
    assert (cold.predict(fsdp_off, H200).source, cold.predict(fsdp_off, H200).unit) == ("model", "tokens/s")
    assert cold.predict(fsdp_off, H200).value > cold.predict(ds_off, H200).value      # the model's order
    unknown = PL.Hardware(gpus=1, gpu_memory_bytes=24 * GiB, host_memory_bytes=64 * GiB, gpu_name="Some GPU")
    assert cold.predict(fsdp_off, unknown).unit == "relative"       # a card the model does not know: the factors
    assert cold.predict(fsdp_off, unknown).value > cold.predict(ds_off, unknown).value
    # This machine measured the opposite (slow PCIe, fast CPU Adam, say): the ranking follows it.
    book = SpeedBook([record_of(fsdp_off, H200, 1000.0, "run"), record_of(ds_off, H200, 3000.0, "tune probe")])
    assert book.predict(fsdp_off, H200).value == 1000.0 and book.predict(fsdp_off, H200).source == "measured"
    # settings never measured are scaled by what their strategy measured here, in tokens/s
    ds_mb8 = PL.replace_cfg(ds_off, ("train", "micro_batch", 8))
    p = book.predict(ds_mb8, H200)
    assert p.source == "scaled" and p.unit == "tokens/s" and p.value > 3000.0      # larger micro-batch, same ratio
    # another machine's measurements do not count here
    other = PL.Hardware(gpus=1, gpu_memory_bytes=24 * GiB, host_memory_bytes=64 * GiB, gpu_name="RTX 3090")
    assert book.predict(fsdp_off, other).source == "model"
    # plan --fit and the hint after a GPU OOM rank with the same book
    cands = PL.settings_that_fit(_cfg(), PL.Hardware(1, 24 * GiB, 125 * GiB, "NVIDIA H200"), resolve("1b"), book=book)
    first_off = next(c for c in cands if "offload" in c.name)
    assert first_off.name.startswith("ZeRO-3+offload") and first_off.speed_unit == "tokens/s"


def test_the_options_keep_the_global_batch_and_what_the_user_fixed():
    base = C.build({"model": {"name": "1b"}, "data": {"seq_len": 2048}, "parallel": {"device": "cuda"},
                    "train": {"micro_batch": 4, "grad_accum": 2}, "memory": {"gpu_memory_limit": "26GiB"}}, "test")   # a 26 GB device
    opts = search.options(base, resolve("1b"), H200, SpeedBook([]), fixed={"memory.activation_checkpointing"})
    assert sum(o.baseline for o in opts) == 1
    assert {o.cfg.train.micro_batch * o.cfg.train.grad_accum for o in opts} == {8}
    assert {o.cfg.memory.activation_checkpointing for o in opts} == {False}
    assert {o.cfg.train.micro_batch for o in opts} >= {1, 2, 4, 8}
    assert all(o.estimate.fits for o in opts if not o.baseline)
    assert {search.strategy_of(o.cfg) for o in opts} >= {"full_shard", "full_shard+offload", "ZeRO-3"}
    values = [o.prediction.value for o in opts]
    assert values == sorted(values, reverse=True)


# ---------------------------------------------------------------------------------------------------
# The command's input

@pytest.mark.parametrize("argv, says", [
    (["--preset", "tiny-cpu", "--budget", "soon"], "--budget: 'soon' is not a duration"),
    (["--preset", "tiny-cpu", "--max-probes", "0"], "--max-probes: 0 is below 1"),
    (["--preset", "tiny-cpu", "-o", "no good"], "is not a preset name"),
    (["--preset", "tiny-cpu", "-o", "tiny-cpu"], "is a built-in preset"),
    (["--preset", "tiny-cpu", "--gpu-memory", "24GiB"], "their cap is --host-memory"),
    (["--preset", "tiny-cpu", "--set", "train.micro_batch=0"], "micro_batch"),
    (["--preset", "3090-offload"], "no GPU found on this machine"),
    (["--preset", "tiny-cpu", "--vary", "train.micro_batch"], "--vary: 'train.micro_batch' is not a numerics key"),
    (["--preset", "tiny-cpu", "--vary", "precision.dtype", "--set", "precision.dtype=bf16"], "also given with --set"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    assert cli.main(["tune", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_dry_run_lists_the_ranked_options_and_probes_nothing(capsys, tmp_path):
    assert cli.main(["tune", "--preset", "tiny-cpu", "--dry-run", "--runs-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[baseline] full_shard, no checkpointing, micro_batch 4 x 1" in out
    assert "relative (cold start)" in out
    assert not list(tmp_path.iterdir())
    assert not speeds_file().exists()
    json.dumps(out)


# ---------------------------------------------------------------------------------------------------
# The console's tune screen (ctrl+t on the setup screen): the same loop, its table live

async def test_the_console_tunes_from_the_setup_screen(tmp_path, _runs_root):
    from textual.widgets import DataTable, Input, Static

    from shardconsole.console.screens.tune import TuneScreen
    from test_console import make_app
    app = make_app(tmp_path)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("ctrl+t")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, TuneScreen)
        screen.query_one("#budget", Input).value = "soon"
        await pilot.click("#start")
        await pilot.pause()
        assert screen.query_one("#budget", Input).has_class("-invalid") and not screen.running
        assert not list(_runs_root.iterdir())                      # nothing launched
        # one probe with a budget too short to finish: launched, stopped by the normal stop path, reported
        screen.query_one("#budget", Input).value = "2s"
        screen.query_one("#probes", Input).value = "1"
        await pilot.press("ctrl+g")                 # Start (the first refusal's toast covers the button)
        for _ in range(600):          # until the worker has run the probe and the screen says so
            await pilot.pause(0.1)
            if screen.tune is not None and screen.tune.rows and not screen.running:
                break
        assert screen.tune is not None and not screen.running
        status = str(screen.query_one("#status", Static).render())
        rows = [screen.query_one(DataTable).get_row_at(i) for i in range(screen.query_one(DataTable).row_count)]
        assert rows, status
        # the cells are rich Text where they wrap (console/screens/tune.py): their plain text is what is read
        assert str(rows[0][1]).startswith("baseline: ") and str(rows[0][-1]).startswith(("timeout", "stopped"))
        assert "nothing saved" in str(screen.query_one("#status", Static).render())
        probe = screen.tune.root / "probe-01"
        assert (probe / "job.json").is_file()
