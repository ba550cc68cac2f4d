"""The console: its pure parts as plain tests, its behaviour through Textual's pilot, and one real run.

The app is built with fakes (FakeLauncher, FakeProbes) except in the `slow` test, which launches a real
tiny-cpu run (2 CPU ranks over gloo) through the real launcher and stops it from the UI.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.launch.job import METRICS_FILE, PRESET_FILE, RUN_FILE, StopReport, build_argv
from shardconsole.runlog.stream import MetricsWriter

from shardconsole.console import fields as F
from shardconsole.console.app import ShardConsoleApp
from shardconsole.session.logtail import LogTail
from shardconsole.session.run import RunSession
from shardconsole.session.watcher import Watcher
from shardconsole.console.runview import Trace
from shardconsole.console.services import PlannedRun, RunListing

GIB = 2**30
T0 = 1_800_000_000.0          # frozen wall time of the written streams


# ---------------------------------------------------------------------------------------------------
# Fakes: a launcher that writes a run folder instead of starting ranks, and probes with fixed samples.

class FakeJob:
    def __init__(self, run_dir: Path, *, alive: bool = True, pids: tuple[int, ...] = (5000, 5001),
                 on_stop: Callable[[], None] | None = None) -> None:
        self.run_dir = run_dir
        self._alive = alive
        self.pids = pids
        self.on_stop = on_stop
        self.stops = 0
        self.external = False
        self.rc_known = True      # poll() answers for the fake launcher
        self.pid = 0

    def poll(self) -> int | None:
        return None if self._alive else 0

    def heard(self, hellos) -> None:
        pass

    def alive(self) -> bool:
        return self._alive

    def stop(self, grace_s: float, rank_pids, *, who: str, hurry) -> StopReport:
        self.stops += 1
        self.stopped_by = who
        self._alive = False
        if self.on_stop:
            self.on_stop()
        return StopReport(signalled=[1000, *self.pids], killed=False, left=[], seconds=0.4)


def fake_session(job: FakeJob, run_id: str = "", *, started_here: bool = False) -> RunSession:
    """The run session the console renders, over a FakeJob: the session's own settings, watcher, hang
    policy and outcome; only the stop is the fake's (nothing to signal)."""
    return RunSession(job, job.run_dir, run_id, started_here=started_here,
                      stop_with=lambda j, pids, *, who, grace_s, hurry, **_: j.stop(grace_s, pids, who=who, hurry=hurry))


class FakeLauncher:
    resume = None       # a launcher that cannot resume: the run screen offers no resume (test_console_run's can)

    def __init__(self, runs_root: Path, *, run_name: str = "20260101-000000-tiny-cpu",
                 write: Callable[[Path], None] | None = None, alive: bool = True,
                 on_stop: Callable[[], None] | None = None) -> None:
        self.runs_root = runs_root
        self.run_name = run_name
        self.write = write
        self.alive = alive
        self.on_stop = on_stop
        self.started: list[C.RunConfig] = []
        self.jobs: list[FakeJob] = []

    def plan(self, cfg: C.RunConfig, preset_name: str) -> PlannedRun:
        run_dir = self.runs_root / self.run_name
        return PlannedRun(run_dir, self.run_name, build_argv(cfg, run_dir, self.run_name, python="python"))

    def start(self, resolved: Any, planned: PlannedRun) -> RunSession:
        planned.run_dir.mkdir(parents=True, exist_ok=True)
        C.save(resolved.cfg, planned.run_dir / PRESET_FILE)
        if self.write:
            self.write(planned.run_dir)
        self.started.append(resolved.cfg)
        self.jobs.append(FakeJob(planned.run_dir, alive=self.alive, on_stop=self.on_stop))
        return fake_session(self.jobs[-1], started_here=True)

    def attach(self, run_dir: Path) -> RunSession:
        self.jobs.append(FakeJob(Path(run_dir), alive=self.alive, on_stop=self.on_stop))
        return fake_session(self.jobs[-1])

    def recent_runs(self, limit: int = 30) -> list[RunListing]:
        return [RunListing(d, "", self.alive) for d in sorted(self.runs_root.glob("*"))][:limit]


def gpu_sample(i: int, used_gib: float, t: float = T0, pids: tuple[int, ...] = ()) -> P.GpuSample:
    return P.GpuSample(t=t, index=i, name="NVIDIA H200", used_bytes=int(used_gib * GIB),
                       total_bytes=int(139.8 * GIB), util_pct=87.0, pids=pids)


class FakeProbes:
    """Fixed samples (with a fixed time, so frozen screens stay frozen however often they are taken)."""

    def __init__(self, gpus: list[P.GpuSample] | None = None, host: P.HostSample | None = None,
                 unavailable: str = "") -> None:
        self._gpus = gpus or []
        self._host = host or P.HostSample(t=T0, used_bytes=40 * GIB, total_bytes=125 * GIB,
                                          ranks_rss_bytes=12 * GIB, pinned_bytes=2 * GIB)
        self.unavailable = unavailable

    @classmethod
    def like(cls, run_dir: Path) -> "FakeProbes":
        """Probes that answer what the run's stream last says, so a frozen screen is the same whether
        or not the console's own first sample has arrived when it is taken."""
        messages = [P.decode(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
        gpus = {m.index: m for m in messages if isinstance(m, P.GpuSample)}
        hosts = [m for m in messages if isinstance(m, P.HostSample)]
        return cls(gpus=[gpus[i] for i in sorted(gpus)], host=hosts[-1] if hosts else None,
                   unavailable="" if gpus else NO_GPU)

    def free(self) -> None:
        """What NVML shows once the ranks are gone: the memory is back, no process holds any."""
        self._gpus = [replace(g, used_bytes=int(0.5 * GIB), pids=(), util_pct=0.0) for g in self._gpus]

    def gpu_unavailable(self) -> str:
        return self.unavailable

    def gpus(self, run: str = "") -> list[P.GpuSample]:
        return [replace(g, run=run) for g in self._gpus]

    def host(self, rank_pids: Any = (), run: str = "") -> P.HostSample:
        return replace(self._host, run=run)


NO_GPU = "no NVIDIA GPU driver (NVMLError_LibraryNotFound)"


def real_planner() -> Any:
    """The real planner (shardconsole.plan): pure and instant, so no stand-in."""
    from shardconsole import plan
    return plan


def write_run(run_dir: Path, *, gpus: int = 2, ranks_per_gpu: int = 1, steps: int = 12, total_steps: int = 30,
              device: str = "cuda", cfg: C.RunConfig | None = None, finished: bool = False, fp8: str = "",
              host: str | None = None) -> None:
    """A run folder as the ranks and the headless front end leave it: preset, job, metrics, logs. host: where
    the ranks said hello from (this host by default; their pids are not real ranks, so a run with no job.json
    whose ranks are here is one whose every rank is gone: session/faults/lost.py)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    run = run_dir.name
    world = max(1, gpus) * ranks_per_gpu
    default = {"parallel": {"nproc_per_node": world, "device": "cuda" if device == "cuda" else "cpu"}}
    C.save(cfg or C.build(default), run_dir / PRESET_FILE)
    (run_dir / RUN_FILE).write_text(json.dumps({"pid": 999999, "pgid": 999999, "argv": ["python"]}))
    w = MetricsWriter(run_dir / METRICS_FILE, run, 0)
    t = T0 - 60
    for r in range(world):
        w.emit(P.Hello(run=run, rank=r, t=t, world=world, local_rank=r, host=host or socket.gethostname(), pid=5000 + r,
                       device=f"cuda:{r % gpus}" if device == "cuda" else "cpu", backend="fsdp", n_params=940_600_000))
    for phase in ("starting", "loading model", "training"):
        w.emit(P.Event(run=run, rank=0, t=t, name="phase", detail=phase))
    for s in range(1, steps + 1):
        t = T0 - 60 + 5 * s
        for g in range(gpus):
            w.emit(gpu_sample(g, 20 + 1.5 * s / steps * (1 + g), t=t))
        w.emit(P.HostSample(run=run, t=t, used_bytes=int((30 + s) * GIB), total_bytes=125 * GIB,
                            ranks_rss_bytes=int(6 * GIB), pinned_bytes=int(2 * GIB) if device == "cuda" else None))
        for r in range(world):
            cuda = device == "cuda"
            w.emit(P.Memory(run=run, rank=r, t=t, step=s, device_index=r % gpus if cuda else None,
                            allocated_bytes=int(15 * GIB) if cuda else None,
                            reserved_bytes=int((18 + 0.1 * r) * GIB) if cuda else None,
                            peak_reserved_bytes=int(21 * GIB) if cuda else None, host_rss_bytes=int(3 * GIB)))
        w.emit(P.Step(run=run, rank=0, t=t, step=s, steps=total_steps, loss=10.4 - 5 * (1 - 0.8 ** s), lr=3e-4,
                      grad_norm=1.2, tokens_per_s=61_500 + 300 * (s % 3), samples_per_s=30.0, step_s=0.27,
                      mfu=0.508 if device == "cuda" else None, tokens=s * 16_384, fp8=fp8))
    if finished:
        w.emit(P.Event(run=run, rank=0, t=t, name="phase", detail="finished"))
        w.emit(P.Finished(run=run, rank=0, t=t, steps=steps))
    w.close()
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    for r in range(min(world, 2)):
        (logs / f"rank{r}.log").write_text("".join(f"[rank {r}] step {s} done\n" for s in range(1, 4)))
    (run_dir / "launcher.log").write_text("torchrun: starting 2 workers\n")


async def wait_for(pilot: Any, condition: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
    """Let the app run until condition() is true (workers and messages take a few frames). The timeout
    is a cap for a broken app, not a pace: CI's loaded machine once needed more than 10 s for a focus."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        await pilot.pause(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")


def text_of(widget: Any) -> str:
    """The plain text a Static shows."""
    return str(widget.render())


async def show_table(pilot: Any, setup: Any, table: str) -> None:
    """Open a table's tab (its form is built when first shown)."""
    from textual.widgets import TabbedContent
    setup.query_one(TabbedContent).active = f"tab-{table}"
    await wait_for(pilot, lambda: setup.query(f"#form-{table} SettingField"), what=f"the {table} form")
    # The focus goes along, as ctrl+n does: left in the hidden pick tab, it would switch back to it.
    control = setup.query_one(f"#form-{table}").query(".setting--control").first()

    def focused() -> bool:
        # Asked again until it holds: a focus asked before the new tab is shown is dropped, and the tab
        # then goes back to where the focus is (a CI emulation waited 60 s on the one request).
        if pilot.app.focused is control:
            return True
        setup.query_one(TabbedContent).active = f"tab-{table}"
        control.focus()
        return False

    control.focus()
    # Focus moves on a later message; its row's highlight is drawn after that (snapshots saw either).
    await wait_for(pilot, focused, what=f"the focus in the {table} form")
    await pilot.pause()


def make_app(tmp_path: Path, *, preset: str = "tiny-cpu", overrides: list[str] | None = None,
             probes: FakeProbes | None = None, launcher: FakeLauncher | None = None, **kw: Any) -> ShardConsoleApp:
    return ShardConsoleApp(launcher or FakeLauncher(tmp_path / "runs"), probes or FakeProbes(unavailable=NO_GPU),
                           preset=preset, overrides=overrides, planner=kw.pop("planner", lambda: None), **kw)


# ---------------------------------------------------------------------------------------------------
# Pure parts

def test_widget_kind_follows_the_annotation():
    kinds = {s.key: s for s in F.table_specs("precision") + F.table_specs("fsdp") + F.table_specs("train")}
    assert kinds["dtype"].kind == "select" and kinds["dtype"].choices == ("bf16", "fp16", "fp32")
    assert kinds["reduce_dtype"].kind == "select" and kinds["reduce_dtype"].choices[0] == F.DEFAULT_CHOICE
    assert kinds["cpu_offload"].kind == "switch"
    assert kinds["reshard_after_forward"].choices == (F.DEFAULT_CHOICE, "true", "false")   # bool | None
    assert kinds["steps"].kind == "number" and kinds["lr"].kind == "number"
    assert kinds["initial_scale_power"].optional
    assert F.spec_for("memory", "gpu_memory_limit").kind == "size"
    assert [s.key for s in F.table_specs("model")] == ["attn_implementation"]   # name is on the pick tab


def test_only_the_chosen_backends_table_is_shown():
    assert "fsdp" in F.visible_tables("fsdp") and "deepspeed" not in F.visible_tables("fsdp")
    assert "deepspeed" in F.visible_tables("deepspeed") and "fsdp" not in F.visible_tables("deepspeed")


def test_an_objectives_table_is_shown_under_that_objective_only():
    """[preference] under DPO / ORPO / SimPO / KTO, [grpo] under GRPO: neither under SFT (the form would list
    settings the run never reads, and the tab keys would walk through them)."""
    shown = {o: {"preference", "grpo"} & set(F.visible_tables("fsdp", "full", o))
             for o in ("sft", "dpo", "orpo", "simpo", "kto", "grpo")}
    assert shown == {"sft": set(), "dpo": {"preference"}, "orpo": {"preference"}, "simpo": {"preference"},
                     "kto": {"preference"}, "grpo": {"grpo"}}


def test_an_edit_is_the_clis_override_and_its_error_names_the_field():
    from shardconsole.settings import resolve as settings
    spec = F.spec_for("train", "steps")
    assert F.override_for(spec, " 0 ") == "train.steps=0"
    r = settings.resolve("tiny-cpu", [F.override(spec, "0")], lenient=True)
    e = r.refused["train.steps"]
    assert (e.source, e.table, e.key) == ("console: [train] steps", "train", "steps")
    assert str(e) == "console: [train] steps: 0 is below the minimum 1; optimizer steps to run"
    with pytest.raises(C.ConfigError) as cli:     # the same value from the command line names --set
        settings.resolve("tiny-cpu", ["train.steps=0"])
    assert str(cli.value) == "--set train.steps: 0 is below the minimum 1; optimizer steps to run"
    assert F.override_for(F.spec_for("precision", "reduce_dtype"), F.DEFAULT_CHOICE) == "precision.reduce_dtype=none"
    r = settings.resolve("tiny-cpu", [F.override(F.spec_for("precision", "reduce_dtype"), F.DEFAULT_CHOICE)])
    assert r.cfg.precision.reduce_dtype is None


def test_the_console_starts_from_what_the_cli_resolved(tmp_path):
    """`shardconsole --preset P --set ...` resolves once and hands the Resolved over: the screen keeps
    each override with its --set source, and a later edit of that field takes the field's source."""
    from shardconsole.settings import resolve as settings
    resolved = settings.resolve("3090-offload", ["train.steps=5", "parallel.backend=deepspeed"])
    app = ShardConsoleApp(FakeLauncher(tmp_path / "runs"), FakeProbes(unavailable=NO_GPU), resolved=resolved,
                          planner=lambda: None)
    setup = app.setup_screen
    assert setup.preset_name == "3090-offload" and setup.cfg == resolved.cfg
    assert setup.resolved.origins == {"train.steps": "--set train.steps", "parallel.backend": "--set parallel.backend"}
    assert setup.notes == resolved.notes and any("offload_param" in n for n in setup.notes)
    setup.overrides["train.steps"] = F.override(F.spec_for("train", "steps"), "0")   # what an edit does
    setup._derive(notify=False)      # (no app running: the widgets are not redrawn)
    assert str(setup.resolved.refused["train.steps"]).startswith("console: [train] steps: 0 is below the minimum 1")


def test_text_round_trips_through_the_override():
    cfg = C.build({"deepspeed": {"reduce_bucket_size": 500_000_000}, "train": {"lr": 6e-5},
                   "memory": {"gpu_memory_limit": "24GiB"}})
    for table in C.TABLES:
        for spec in F.table_specs(table):
            value = F.value_of(cfg, spec)
            if value is None:
                continue     # "not set" has no override (config.py refuses `--set key=none`)
            again = C.copy(cfg)
            C.apply_overrides(again, [F.override_for(spec, F.to_text(spec, value))])
            assert F.value_of(again, spec) == value, spec.path


def test_trace_stays_bounded_and_keeps_the_newest_point():
    trace = Trace(max_points=64)
    for i in range(1000):
        trace.append(i, float(i))
    assert len(trace) <= 64 and trace.xs[-1] == 999 and trace.last == 999


def test_follower_reads_the_stream_and_logs_and_writes_its_samples(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    write_run(run_dir, gpus=1, steps=3)
    probes = FakeProbes(gpus=[gpu_sample(0, 30.0)])
    watcher = Watcher(FakeJob(run_dir), run_dir, "r1", probes, sample_every_s=0.0)
    first = watcher.poll()
    assert sum(isinstance(m, P.Step) for m in first.messages) == 3
    assert any("[rank 0] step 1 done" in line for line in first.log_lines)
    assert watcher.rank_pids == [5000]
    second = watcher.poll()    # the samples written by the first look come back through the file
    assert {type(m) for m in second.messages} == {P.GpuSample, P.HostSample}
    watcher.close()


def test_log_tail_starts_near_the_end_of_a_long_log(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank3.log").write_text("".join(f"line {i}\n" for i in range(20_000)))
    lines = LogTail(tmp_path).poll()
    assert lines[-1] == "    r3│ line 19999" and len(lines) < 2000 and lines[0].endswith(" line " + lines[0].split()[-1])


def test_console_never_imports_the_training_libraries():
    code = ("import sys, shardconsole.console.app, shardconsole.console.screens.run; "
            "bad = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------
# Pilot tests: the setup screen

async def test_pick_a_model_a_preset_and_a_backend(tmp_path):
    from textual.widgets import OptionList, RadioButton, TabbedContent
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        models = setup.query_one("#models", OptionList)
        models.focus()
        await pilot.press("down", "down", "enter")                 # tiny -> 125m -> 1b
        assert setup.cfg.model.name == "1b"
        assert "940.6M params" in text_of(setup.query_one("#model-info"))
        presets = setup.query_one("#presets", OptionList)
        presets.focus()
        presets.highlighted = presets.get_option_index("4090x2-zero3")
        await pilot.press("enter")
        await pilot.pause()
        assert setup.preset_name == "4090x2-zero3" and setup.cfg.parallel.backend == "deepspeed"
        tabs = setup.query_one(TabbedContent)
        assert tabs.get_tab("tab-fsdp").has_class("-hidden") and not tabs.get_tab("tab-deepspeed").has_class("-hidden")
        await pilot.click("#backend-fsdp")
        await pilot.pause()
        assert setup.cfg.parallel.backend == "fsdp"
        assert setup.query_one("#backend-fsdp", RadioButton).value
        assert not tabs.get_tab("tab-fsdp").has_class("-hidden") and tabs.get_tab("tab-deepspeed").has_class("-hidden")
        assert "parallel.backend deepspeed → fsdp" in text_of(setup.query_one("#changes"))


async def test_a_bad_value_is_marked_at_its_field_and_blocks_the_launch(tmp_path):
    from shardconsole.console.widgets.setting_field import SettingField
    launcher = FakeLauncher(tmp_path / "runs")
    app = make_app(tmp_path, launcher=launcher)
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        for _ in range(3):
            await pilot.press("ctrl+n")                             # Pick -> model -> data -> train
        field = setup.query_one("#field-train-steps", SettingField)
        assert app.focused is field.query_one(".setting--control")
        await pilot.press("end", "backspace", "backspace", "0")
        await pilot.pause()
        assert field.error == "0 is below the minimum 1; optimizer steps to run"
        assert field.has_class("-invalid")
        assert "0 is below the minimum 1" in text_of(field.query_one(".setting--note"))
        assert "train.steps: 0 is below the minimum 1" in text_of(setup.query_one("#problems"))
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert launcher.started == [] and app.screen is setup
        await pilot.press("backspace", "8")
        await pilot.pause()
        assert field.error == "" and setup.cfg.train.steps == 8
        assert "train.steps 30 → 8" in text_of(setup.query_one("#changes"))


async def test_an_impossible_combination_is_marked_at_the_field_it_names(tmp_path):
    from textual.widgets import Select
    from shardconsole.console.widgets.setting_field import SettingField
    app = make_app(tmp_path, preset="4090x2-zero3")
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        await show_table(pilot, setup, "precision")
        setup.query_one("#field-precision-dtype", SettingField).query_one(Select).value = "bf16"
        await pilot.pause()
        # The preset's own fp16 keys are dropped with a note, as on the command line ...
        await wait_for(pilot, lambda: "loss_scale_window = 100 ignored" in text_of(setup.query_one("#changes")),
                       what="the note")
        # ... but one typed in its field with bf16 is impossible, and marked there.
        field = setup.query_one("#field-precision-loss_scale_window", SettingField)
        field.query_one(".setting--control").value = "50"
        await wait_for(pilot, lambda: field.error, what="the mark at the field")
        assert field.error == ("is an fp16 loss-scale setting but dtype is 'bf16'; remove it or set "
                               "precision.dtype = \"fp16\"")
        assert setup.query_one("#field-precision-dtype", SettingField).error == ""
        assert text_of(setup.query_one("#problems")).startswith("✗ precision.loss_scale_window: is an fp16")


async def test_save_a_preset_and_load_it_back(tmp_path, _user_presets):
    from textual.widgets import Input, OptionList
    app = make_app(tmp_path, overrides=["train.steps=7", "train.log_every=1"])
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "SavePresetScreen")
        app.screen.query_one("#name", Input).value = "my-tiny"
        app.screen.query_one("#description", Input).value = "tiny, 7 steps"
        await pilot.press("enter")
        path = _user_presets / "my-tiny.toml"
        await wait_for(pilot, path.exists, what="the preset file")
        loaded = C.load(path)
        expected = C.copy(setup.cfg)
        assert loaded.description == "tiny, 7 steps" and loaded.train.steps == 7
        assert C.dumps(loaded) == C.dumps(expected)
        assert setup.preset_name == "my-tiny" and "none" in text_of(setup.query_one("#changes"))
        assert setup.query_one("#presets", OptionList).get_option("my-tiny")

        # The same name again: asked first; "n" keeps the file as it was.
        await show_table(pilot, setup, "train")
        setup.query_one("#field-train-steps").query_one(Input).value = "9"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "SavePresetScreen")
        await pilot.press("enter")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen")
        await pilot.press("n")
        # The answer is processed once the question is gone (a positive event); only then is "kept" checked.
        await wait_for(pilot, lambda: type(app.screen).__name__ not in ("ConfirmScreen", "SavePresetScreen"),
                       what="the answer")
        assert C.load(path).train.steps == 7
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "SavePresetScreen")
        await pilot.press("enter")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen")
        await pilot.press("y")
        await wait_for(pilot, lambda: C.load(path).train.steps == 9, what="the overwrite")


async def test_a_wrong_data_path_typed_in_the_console_names_the_field(tmp_path):
    """The launch runs --headless's preflight on what the screen resolved: the error names the console
    field the value came from (not the preset file), the focus goes to it, and nothing starts."""
    from textual.widgets import Input, Select
    from shardconsole.console.widgets.setting_field import SettingField
    launcher = FakeLauncher(tmp_path / "runs")
    app = make_app(tmp_path, launcher=launcher)
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        await wait_for(pilot, lambda: setup.machine.detected)
        await show_table(pilot, setup, "data")
        setup.query_one("#field-data-source", SettingField).query_one(Select).value = "auto"
        path_field = setup.query_one("#field-data-path", SettingField)
        # Checked at the field as it is typed, with the launch's own words: a kind the ranks cannot read,
        # a file that is not text, then a file that does not exist.
        (tmp_path / "corpus.docx").write_text("x")
        (tmp_path / "blob.jsonl").write_bytes(b"\x00\x01")
        for name, words in (("corpus.docx", "unknown file type '.docx'"), ("blob.jsonl", "not a text file"),
                            ("nowhere.txt", "no such file or folder")):
            path_field.query_one(Input).value = str(tmp_path / name)
            await wait_for(pilot, lambda: words in path_field.error, what=f"{words} at the field")
            assert "data.path" in text_of(setup.query_one("#problems"))
        (tmp_path / "chats.jsonl").write_text('{"text": "hello"}\n')
        path_field.query_one(Input).value = str(tmp_path / "chats.jsonl")
        await wait_for(pilot, lambda: path_field.error == "", what="a good file accepted")
        path_field.query_one(Input).value = str(tmp_path / "nowhere.txt")
        await wait_for(pilot, lambda: setup.cfg.data.path == str(tmp_path / "nowhere.txt"), what="the edit")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app._notifications, what="the refusal")
        note = str(list(app._notifications)[-1].message)
        assert note == f"data.path: {tmp_path / 'nowhere.txt'}: no such file or folder"
        await wait_for(pilot, lambda: app.focused is path_field.query_one(".setting--control"), what="the focus")
        assert launcher.started == [] and app.screen is setup


async def test_the_save_dialog_refuses_a_bad_name_and_starts_without_a_description(tmp_path, _user_presets):
    from textual.widgets import Input
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+s")
        dialog = await wait_for(pilot, lambda: type(app.screen).__name__ == "SavePresetScreen" and app.screen)
        assert dialog.query_one("#description", Input).value == ""      # not tiny-cpu's description
        # Judged as it is typed: the label's rule (letters, digits, - and _), Save off until it holds.
        for name in ("my tiny", "myreset!", "-x", ""):
            dialog.query_one("#name", Input).value = name
            await wait_for(pilot, lambda: dialog.query_one("#save").disabled, what=f"{name!r} refused")
            assert "✗" in text_of(dialog.query_one("#where")), name
        dialog.query_one("#name", Input).value = "my_tiny-2"
        await wait_for(pilot, lambda: not dialog.query_one("#save").disabled, what="a good name")
        assert text_of(dialog.query_one("#where")).endswith("my_tiny-2.toml")
        for name, words in (("my tiny", "not a preset name"), ("my.toml", "leave out .toml"),
                            ("tiny-cpu", "is a built-in preset")):
            dialog.query_one("#name", Input).value = name
            await pilot.press("enter")
            await wait_for(pilot, lambda: any(words in str(n.message) for n in app._notifications), what=words)
            assert app.screen is dialog
        assert list(_user_presets.iterdir()) == []


async def test_the_memory_estimate_shows_a_placeholder_without_the_planner(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.setup_screen.machine.detected)
        assert "not available" in text_of(app.setup_screen.query_one("#estimate"))
    # The real planner on two fake H200s: a 1b model with FSDP2 on 2 GPUs fits with room to spare.
    probes = FakeProbes(gpus=[gpu_sample(0, 0.5), gpu_sample(1, 0.5)])
    app = make_app(tmp_path, planner=real_planner, probes=probes,
                   overrides=["model.name=1b", "parallel.device=cuda", "data.seq_len=1024"])
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.setup_screen.machine.detected)
        await pilot.pause()
        line = text_of(app.setup_screen.query_one("#estimate"))
        assert line.startswith("Estimate: GPU peak ") and "host peak" in line and "· fits" in line, line


async def test_a_gpu_preset_without_a_gpu_estimates_the_cpu_run(tmp_path):
    """The ranks of a GPU preset run on the CPU here: the estimate is that run's (no GPU peak under the
    warning that there is no GPU)."""
    app = make_app(tmp_path, preset="3090-offload", planner=real_planner)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.setup_screen.machine.detected)
        await pilot.pause()
        assert "no GPU here" in text_of(app.setup_screen.query_one("#problems"))
        line = text_of(app.setup_screen.query_one("#estimate"))
        assert line.startswith("Estimate on the CPU (no GPU here; rough): host peak ") and "GPU" not in \
            line.split(")", 1)[1], line


async def test_up_and_down_move_between_fields(tmp_path):
    """Up/down go from field to field as Tab does; a select opens with enter (its list takes the arrows
    then), an input keeps left/right for its cursor."""
    from textual.widgets import Input, Select
    from shardconsole.console.widgets.setting_field import SettingField
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        # the pick tab: from the model folder field up to the model list, down to the backend
        model_dir = setup.query_one("#model-dir", Input)
        model_dir.focus()
        await pilot.press("up")
        await wait_for(pilot, lambda: app.focused is setup.query_one("#models"), what="the model list")
        model_dir.focus()
        await pilot.press("down")
        await wait_for(pilot, lambda: app.focused is setup.query_one("#backend"), what="the backend")
        await show_table(pilot, setup, "train")
        rows = list(setup.query(f"#form-train {SettingField.__name__}"))
        controls = [r.query_one(".setting--control") for r in rows]
        assert app.focused is controls[0]
        for i in range(1, 4):
            await pilot.press("down")
            await wait_for(pilot, lambda: app.focused is controls[i], what=f"field {i}")
        await pilot.press("up")
        await wait_for(pilot, lambda: app.focused is controls[2], what="back up")
        await pilot.press("up", "up", "up")                       # the first field stays the first
        await wait_for(pilot, lambda: app.focused is controls[0], what="the top")
        # a select in some table: down passes it by, enter opens it and down moves in its list
        await show_table(pilot, setup, "precision")
        rows = list(setup.query("#form-precision SettingField"))
        at = next(i for i, r in enumerate(rows) if r.query(Select))
        select = rows[at].query_one(Select)
        select.focus()
        await wait_for(pilot, lambda: app.focused is select)
        await pilot.press("down")
        await wait_for(pilot, lambda: app.focused is rows[at + 1].query_one(".setting--control"), what="past")
        select.focus()
        await wait_for(pilot, lambda: app.focused is select)
        before = select.value
        await pilot.press("enter")
        await wait_for(pilot, lambda: select.expanded, what="the list open")
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: select.value != before and not select.expanded, what="another choice")
        # an input: left/right move its cursor, the focus stays
        steps = setup.query_one("#field-train-steps", SettingField).query_one(Input)
        await show_table(pilot, setup, "train")
        steps.focus()
        await wait_for(pilot, lambda: app.focused is steps)
        steps.cursor_position = len(steps.value)
        await pilot.press("left")
        assert app.focused is steps and steps.cursor_position == len(steps.value) - 1


@pytest.mark.parametrize("size", [(80, 40), (120, 40), (80, 24)], ids=["80x40", "120x40", "80x24"])
async def test_nothing_of_the_summary_is_cut_where_there_are_rows_for_it(tmp_path, size):
    """The whole command (its last line too), the machine line and the estimate, at 80 and 120 columns.
    Under 30 rows (issue 49.9: at 80x24 the summary took 12 of 20 rows, Backend and Method went below
    the Pick tab's edge) the estimate with its verdict stays whole; the command and the machine line are
    one line each, cut with "…" (the whole command: --print-command or a taller terminal).
    test_console_layout checks the Pick tab and a form there."""
    app = make_app(tmp_path, preset="3090-offload", planner=real_planner)
    async with app.run_test(size=size) as pilot:
        setup = app.setup_screen
        await wait_for(pilot, lambda: setup.machine.detected)
        await pilot.pause()
        short = size[1] < 30
        for wid in ("#command", "#machine", "#estimate"):
            widget = setup.query_one(wid)
            lines = widget.render_lines(widget.region.reset_offset)     # what is drawn, by row
            drawn = " ".join(line.text.strip() for line in lines)
            assert widget.display and widget.region.height > 0, wid
            full = text_of(widget)
            assert full.split()[0] in drawn, (wid, drawn)
            if short and wid != "#estimate":
                assert len(lines) == 1 and drawn.endswith("…"), (wid, drawn)
                continue
            assert "…" not in drawn, (wid, drawn)
            assert full.split()[-1] in drawn, (wid, drawn)
        command = setup.query_one("#command")
        assert ("--run-id" in " ".join(s.text for s in command.render_lines(command.region.reset_offset))) != short


# ---------------------------------------------------------------------------------------------------
# Pilot tests: the run screen, with a fake launcher writing a frozen stream

async def test_the_throughput_panel_says_when_the_linears_run_in_fp8(tmp_path):
    """precision.fp8: the step's MFU is still a share of the bf16 peak, and the panel says fp8 is on."""
    from shardconsole.console.screens.run import RunScreen
    for fp8, want in (("tensorwise", "MFU 50.8% (fp8 tensorwise, of bf16 peak)"), ("", "MFU 50.8%")):
        launcher = FakeLauncher(tmp_path / f"runs-{fp8}", write=lambda d: write_run(d, gpus=1, steps=4, fp8=fp8))
        app = make_app(tmp_path, launcher=launcher, probes=FakeProbes(gpus=[gpu_sample(0, 21.5, pids=(5000,))]))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("ctrl+r")
            screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
            await wait_for(pilot, lambda: screen.view.state.last_step and screen.view.state.last_step.step == 4)
            text = await wait_for(pilot, lambda: "MFU" in text_of(screen.query_one("#throughput-text"))
                                  and text_of(screen.query_one("#throughput-text")))
            assert want in text and (("fp8" in text) == bool(fp8)), text


async def test_launch_watch_and_stop_with_a_fake_launcher(tmp_path):
    from shardconsole.console.screens.run import RunScreen
    launcher = FakeLauncher(tmp_path / "runs", write=lambda d: write_run(d, gpus=2, steps=12))
    probes = FakeProbes(gpus=[gpu_sample(0, 21.5, pids=(5000,)), gpu_sample(1, 22.0, pids=(5001,))])
    app = make_app(tmp_path, launcher=launcher, probes=probes)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+r")
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        await wait_for(pilot, lambda: screen.view.state.last_step and screen.view.state.last_step.step == 12)
        await pilot.pause(0.2)
        assert "step 12/30" in text_of(screen.query_one("#status"))
        gpu = text_of(screen.query_one("#gpu-text"))
        assert "gpu0" in gpu and "r0 reserved 18.0 · peak 21.0 GiB" in gpu and "87%" in gpu
        assert "61.5k tok/s" in text_of(screen.query_one("#throughput-text"))
        assert "MFU 50.8%" in text_of(screen.query_one("#throughput-text"))
        assert "loss scale n/a" in text_of(screen.query_one("#loss-text"))
        assert "RAM" in text_of(screen.query_one("#host-text"))
        await pilot.press("s")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen")
        await pilot.press("y")
        await wait_for(pilot, lambda: screen.status == "stopped", what="the stop")
        report = await wait_for(pilot, lambda: type(app.screen).__name__ == "ReportScreen" and app.screen.query("#body")
                                and app.screen)
        body = text_of(report.query_one("#body"))
        assert "none left" in body and "rank 0 (pid 5000): ended" in body
        assert launcher.jobs[0].stops == 1
        await pilot.press("enter")
        assert "none left" in text_of(screen.query_one("#status"))
        await pilot.press("n")                                      # back to the setup, for another run
        await wait_for(pilot, lambda: app.screen is app.setup_screen)


async def test_a_launch_past_the_host_ram_asks_first(tmp_path):
    """What `--headless` refuses without --force (the planner's host peak over this machine's RAM), the
    console asks about: "Back" launches nothing, "Launch anyway" launches."""
    from shardconsole.console.screens.run import RunScreen

    import re
    # The real planner: 1b on two CPU ranks (fp32 weights, gradients and Adam moments per rank) on a
    # host of 4 GiB is over its RAM many times.
    small_host = FakeProbes(unavailable=NO_GPU, host=P.HostSample(t=T0, used_bytes=GIB, total_bytes=4 * GIB))
    launcher = FakeLauncher(tmp_path / "runs", write=lambda d: write_run(d, gpus=0, device="cpu", steps=2))
    app = make_app(tmp_path, launcher=launcher, planner=real_planner, probes=small_host,
                   overrides=["model.name=1b"])
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.setup_screen.machine.detected)
        await pilot.press("ctrl+r")
        ask = await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen" and app.screen)
        m = re.search(r"puts this run at ([\d.]+) GiB of host RAM, over the ([\d.]+) GiB usable here",
                      text_of(ask.query_one("#body")))
        assert m and float(m.group(1)) > 4 > float(m.group(2)) > 0, text_of(ask.query_one("#body"))
        await pilot.press("n")
        await wait_for(pilot, lambda: app.screen is app.setup_screen)
        assert launcher.jobs == []
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen")
        await pilot.press("y")
        await wait_for(pilot, lambda: isinstance(app.screen, RunScreen))
        assert len(launcher.jobs) == 1


async def test_a_launch_without_room_for_its_saves_says_so_and_asks_first(tmp_path):
    """A checkpoint_dir on a tmpfs smaller than one checkpoint: the plan line says so with both figures as
    `--headless` refuses it (issue 30); the launch asks: "Back" launches nothing, "Launch anyway" launches."""
    import subprocess
    from shardconsole.console.screens.run import RunScreen
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        launcher = FakeLauncher(tmp_path / "runs", write=lambda d: write_run(d, gpus=0, device="cpu", steps=2))
        app = make_app(tmp_path, launcher=launcher, planner=real_planner,
                       overrides=[f"train.checkpoint_dir={small / 'ckpt'}"])
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.setup_screen.machine.detected)
            line = await wait_for(pilot, lambda: "disk too small" in (s := text_of(app.setup_screen.query_one(
                "#estimate"))) and s, what="the disk in the plan line")
            assert "the run's saves need 1.9 MiB there" in line and "1.0 MiB free" in line, line
            await pilot.press("ctrl+r")
            ask = await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen" and app.screen)
            body = text_of(ask.query_one("#body"))
            assert "1.0 MiB free" in body and 'train.save_final = "model"' in body, body
            await pilot.press("n")
            await wait_for(pilot, lambda: app.screen is app.setup_screen)
            assert launcher.jobs == []
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen")
            await pilot.press("y")
            await wait_for(pilot, lambda: isinstance(app.screen, RunScreen))
            assert len(launcher.jobs) == 1
    finally:
        subprocess.run(["umount", "--lazy", str(small)], check=True)


async def test_attach_to_a_run_folder_from_the_app(tmp_path):
    from textual.widgets import Input
    from shardconsole.console.screens.run import RunScreen
    run_dir = tmp_path / "runs" / "20260101-000000-done"
    write_run(run_dir, gpus=0, device="cpu", steps=5, total_steps=5, finished=True)
    launcher = FakeLauncher(tmp_path / "runs", alive=False)
    app = make_app(tmp_path, launcher=launcher)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "AttachScreen")
        app.screen.query_one("#path", Input).value = str(run_dir)
        await pilot.press("enter")
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        await wait_for(pilot, lambda: screen.status == "finished")
        assert "finished: 5 steps" in text_of(screen.query_one("#status"))
        assert "No GPU: " + NO_GPU in text_of(screen.query_one("#gpu-text"))
        assert screen.check_action("stop", ()) is False            # nothing left to stop


async def test_a_run_started_elsewhere_is_followed_from_its_stream(tmp_path):
    """A run folder without job.json (--print-command run by hand, a Slurm job): the console follows it,
    refuses to stop what it did not start, and sees the end in the stream."""
    from shardconsole.console.screens.run import RunScreen
    from shardconsole.console.services import TorchrunLauncher
    run_dir = tmp_path / "runs" / "slurm-job"
    write_run(run_dir, gpus=0, device="cpu", steps=3, total_steps=5, host="node9")    # its ranks on another node
    (run_dir / RUN_FILE).unlink()
    app = make_app(tmp_path, attach=run_dir, launcher=TorchrunLauncher(tmp_path / "runs"))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        await wait_for(pilot, lambda: (s := screen.view.state.last_step) is not None and s.step == 3)
        assert screen.status == "running"
        await pilot.press("s")
        # The refusal is a notification: wait for it (positive), then check no stop question came with it.
        await wait_for(pilot, lambda: any("started on other machines" in str(n.message) for n in app._notifications),
                       what="the refusal")
        assert type(app.screen).__name__ != "ConfirmScreen"
        w = MetricsWriter(run_dir / METRICS_FILE, "slurm-job", 0)
        assert "ctrl+c leaves it running" in screen.sub_title, screen.sub_title
        w.emit(P.Finished(run="slurm-job", rank=0, t=T0 + 1, steps=5))
        w.close()
        await wait_for(pilot, lambda: screen.status == "finished", timeout=15)
        # ended: the header says so, not what Ctrl-C would do to a run that is no more
        assert "finished · run slurm-job" in screen.sub_title and "ctrl+c" not in screen.sub_title, screen.sub_title


async def test_a_failed_run_says_why(tmp_path):
    from shardconsole.console.screens.run import RunScreen
    run_dir = tmp_path / "runs" / "oom"
    write_run(run_dir, gpus=1, steps=3)
    w = MetricsWriter(run_dir / METRICS_FILE, "oom", 0)
    w.emit(P.Failed(run="oom", rank=0, t=T0 + 1, cause="gpu_oom", message="CUDA out of memory", step=4,
                    exc_type="OutOfMemoryError", hint="lower train.micro_batch"))
    w.close()
    app = make_app(tmp_path, attach=run_dir, launcher=FakeLauncher(tmp_path / "runs", alive=False))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await wait_for(pilot, lambda: isinstance(app.screen_stack[-2], RunScreen) and app.screen_stack[-2])
        report = await wait_for(pilot, lambda: type(app.screen).__name__ == "ReportScreen" and app.screen.query("#body")
                                and app.screen)
        assert "gpu_oom" in text_of(report.query_one("#title"))
        body = text_of(report.query_one("#body"))
        assert "CUDA out of memory" in body and "lower train.micro_batch" in body
        assert screen.status == "failed" and "gpu_oom" in text_of(screen.query_one("#status"))


async def test_attaching_to_a_folder_that_is_no_run_says_so(tmp_path):
    from textual.widgets import Input
    from shardconsole.console.services import TorchrunLauncher
    app = ShardConsoleApp(TorchrunLauncher(tmp_path / "runs"), FakeProbes(unavailable=NO_GPU), planner=lambda: None)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "AttachScreen")
        app.screen.query_one("#path", Input).value = str(tmp_path)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is app.setup_screen)
        await pilot.pause()
        assert any("not a run folder" in str(n.message) for n in app._notifications)


async def test_quitting_leaves_a_live_run_going(tmp_path):
    run_dir = tmp_path / "runs" / "live"
    write_run(run_dir, steps=3)
    app = make_app(tmp_path, attach=run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: type(app.screen).__name__ == "RunScreen")
        # A key that ends the app never returns from pilot.press (it waits for an idle app), so the
        # press runs beside the test, which waits for the app to have exited.
        press = asyncio.ensure_future(pilot.press("ctrl+q"))
        deadline = time.monotonic() + 10
        while app.return_value is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        press.cancel()
    assert app.return_value == run_dir and app.launcher.jobs[0].stops == 0


FLOOD = """
import select, sys
from shardconsole.runlog import protocol as P
from shardconsole.runlog.stream import MetricsWriter
GIB = 2**30
path, cap, steps_per_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
w = MetricsWriter(path, "big", 0)
s = 200
while s < 200 + cap:    # until the test closes our stdin (it has seen enough), or the cap
    s += 1
    t = 1_800_000_000.0 + s
    for r in range(64):
        w.emit(P.Memory(run="big", rank=r, t=t, step=s, device_index=r % 8, reserved_bytes=20 * GIB,
                        peak_reserved_bytes=22 * GIB, host_rss_bytes=3 * GIB))
    w.emit(P.Step(run="big", rank=0, t=t, step=s, steps=100_000, loss=2.0, tokens_per_s=1e6, step_s=0.01))
    if select.select([sys.stdin], [], [], 1 / steps_per_s)[0]:
        break
print(s)
"""


async def test_many_gpus_and_ranks_keep_the_ui_responsive(tmp_path):
    """8 GPUs with 8 ranks each (64 ranks): a long history to replay, then 64 memory lines and a step
    line 20 times a second from another process, while keys are pressed."""
    from shardconsole.console.screens.run import RunScreen
    run_dir = tmp_path / "runs" / "big"
    write_run(run_dir, gpus=8, ranks_per_gpu=8, steps=200, total_steps=100_000)
    app = make_app(tmp_path, attach=run_dir, probes=FakeProbes(gpus=[gpu_sample(g, 30) for g in range(8)]))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        await wait_for(pilot, lambda: screen.view.state.last_step is not None)
        # The flood writes 20 steps a second until told to end (its stdin closed) or 1,200 steps (a minute):
        # keys are pressed while it runs until the screen has shown three steps, however slow the machine.
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(run_dir / METRICS_FILE), "1200", "20"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        seen: list[int] = []          # the step the screen showed after each key press it handled
        try:
            while flood.poll() is None and len(set(seen)) < 3:
                await pilot.press("tab")
                if flood.poll() is None:      # handled while the flood still wrote
                    seen.append(screen.view.state.last_step.step)
                await pilot.pause(0.1)
        finally:
            last = int(flood.communicate(timeout=30)[0])
        await wait_for(pilot, lambda: screen.view.state.last_step.step == last, timeout=60,
                       what="the console to catch up with the stream")
        print("steps shown after each key press under the flood:", seen)
        # Responsive means keys and stream interleave: presses were handled while the flood still wrote,
        # and between them the screen moved on with the stream. A UI blocked by the stream handles a
        # press only once it is through the lines, so it shows no steps between presses. (Order, not
        # seconds: the test must hold on a loaded machine.)
        assert len(set(seen)) >= 3 and seen == sorted(seen), f"the stream did not move between presses: {seen}"
        assert "8 ranks: reserved" in text_of(screen.query_one("#gpu-text"))


# ---------------------------------------------------------------------------------------------------
# The real thing: a tiny-cpu run launched, watched and stopped from the app

@pytest.mark.slow
async def test_real_tiny_cpu_run_launch_watch_stop(tmp_path, monkeypatch):
    import psutil
    from shardconsole.console.screens.run import RunScreen
    from shardconsole.console.services import MachineProbes, TorchrunLauncher
    monkeypatch.chdir(tmp_path)
    app = ShardConsoleApp(TorchrunLauncher(tmp_path / "runs"), MachineProbes(), preset="tiny-cpu",
                          overrides=["train.steps=2000", "train.log_every=1"], planner=lambda: None)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+r")
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        await wait_for(pilot, lambda: (s := screen.view.state.last_step) is not None and s.step >= 2, timeout=180,
                       what="step 2 of the real run")
        await pilot.pause(0.3)
        step = screen.view.state.last_step.step
        assert f"step {step}/2000" in text_of(screen.query_one("#status"))
        assert "tok/s" in text_of(screen.query_one("#throughput-text"))
        assert "loss " in text_of(screen.query_one("#loss-text"))
        assert "ranks RSS" in text_of(screen.query_one("#host-text"))
        pids = screen.view.state.rank_pids
        assert len(pids) == 2
        await pilot.press("s")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen")
        await pilot.press("y")
        # The report's body is composed a frame after the screen is pushed: wait for the body itself.
        report = await wait_for(pilot, lambda: type(app.screen).__name__ == "ReportScreen" and app.screen.query("#body")
                                and app.screen, timeout=60, what="the stop report")
        body = text_of(report.query_one("#body"))
        assert "none left" in body and "rank 0" in body and "still" not in body
        # "3 process(es)" named: the launcher and the two ranks, in the summary and in the list
        assert "stopped: the launcher (torchrun, pid " in body and "and 2 rank(s) (pid " in body
        assert "✔ launcher (torchrun, pid " in body
        assert "the launcher and 2 rank(s) ended, none left" in text_of(screen.query_one("#status"))
        # The Logs panel: what the stream said of a healthy run, and the stop as a stop (torchrun's
        # SignalException traceback folded into one line, not shown from the top).
        from textual.widgets import Log
        logs = screen.query_one("#logs", Log)
        await wait_for(pilot, lambda: any("a stop, not a crash" in line for line in logs.lines), timeout=20,
                       what="torchrun's stop in the logs")
        assert "    r0│ ▸ training" in logs.lines and any("started: fsdp on cpu" in line for line in logs.lines)
        assert not any("Traceback" in line or "SignalException" in line for line in logs.lines), logs.lines
        for pid in pids:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert screen.status == "stopped"
