"""Issue 37 in the console: a chat with a run's model (the runs screen's `t`), its base beside it, and the
looks of the chat and of the data preview (pytest-textual-snapshot, at 120x40 and 80x24).

The chat screen talks to a real `shardconsole chat --serve` child with the tiny model folder of
test_tryout (its `model` fixture; no training here): tokens stream into the screen, greedy answers equal
transformers' `generate` for the same prompt, and ctrl+c ends an answer, not the app. The snapshots are
greedy (fixed weights, no sampling) and show no paths or timings; the preview's is drawn from a frozen
`shardconsole data --preview --json` answer (tests/data/preview_sample.json): what it shows is tested
against the ranks' tokens in test_tryout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from textual.app import App

from shardconsole.console.messages import ChatHeard
from shardconsole.console.screens.chat import ChatScreen
from shardconsole.tryout import chat_wire as W
from tests.conftest import shardconsole
from tests.hf_fixtures import make_hf_model
from tests.test_console import FakeLauncher, FakeProbes, wait_for, write_run
from tests.test_console_snapshots import WIDE, NARROW, TWO_GPUS, fixed_planner, machine_known, still
from tests.test_tryout import _reference, model  # noqa: F401  (model: the tiny folder, a fixture)

LOAD_S = 240        # a child that imports torch and transformers, on a loaded 2-core box


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Another tiny folder of the same shape and tokenizer: the 'base' the run started from."""
    return make_hf_model(tmp_path_factory.mktemp("tryout-base") / "base", chat_template=True, seed=11)


class ChatHost(App[None]):
    ENABLE_COMMAND_PALETTE = False      # as the console's app

    def __init__(self, target: Path, base: Path | None = None) -> None:
        super().__init__()
        self.target, self.base = target, base

    def on_mount(self) -> None:
        self.push_screen(ChatScreen(self.target, "model", device="cpu", base=self.base))


async def ready(pilot: Any, model: str = W.RUN) -> ChatScreen:
    screen = pilot.app.screen
    await wait_for(pilot, lambda: model in screen.ready or model in screen.unavailable, timeout=LOAD_S,
                   what=f"the {model} model loaded")
    assert model in screen.ready, screen.unavailable
    return screen


async def say(pilot: Any, screen: ChatScreen, text: str, max_new_tokens: int) -> None:
    screen.query_one("#max-new-tokens").value = str(max_new_tokens)
    screen.query_one("#prompt").focus()
    await pilot.press(*text, "enter")
    await wait_for(pilot, lambda: screen.chat.turns and not screen.chat.answering(), timeout=LOAD_S,
                   what="the answers")


async def test_chat_streams_and_greedy_answers_equal_generate_beside_the_base(model, base):
    """At 120x40, the base side by side (ctrl+b): both answer the same prompt, each as `generate` does,
    and the run's answer arrives in pieces before it is done."""
    heard: list[Any] = []
    app = ChatHost(model, base)
    async with app.run_test(size=WIDE, message_hook=lambda m: heard.append(m) if isinstance(m, ChatHeard) else None) \
            as pilot:
        screen = await ready(pilot)
        await pilot.press("ctrl+b")
        await ready(pilot, W.BASE)
        await say(pilot, screen, "what is two plus two?", 24)
        turn = screen.chat.turns[0]
        assert turn.answers[W.RUN].text == _reference(model, "what is two plus two?", 24)
        assert turn.answers[W.BASE].text == _reference(base, "what is two plus two?", 24)
        assert turn.answers[W.BASE].text != turn.answers[W.RUN].text
        events = [m.event for m in heard if m.event is not None and getattr(m.event, "model", "") == W.RUN]
        pieces = [e for e in events if isinstance(e, W.Piece)]
        done = next(i for i, e in enumerate(events) if isinstance(e, W.Done))
        assert len(pieces) > 1 and events.index(pieces[-1]) < done     # streamed, not one block at the end
        # The second message's prompt carries the first answer (multi-turn): the base is given it too.
        await say(pilot, screen, "and three?", 4)
        assert screen.chat.messages()[:3] == [{"role": "user", "content": "what is two plus two?"},
                                              {"role": "assistant", "content": turn.answers[W.RUN].text},
                                              {"role": "user", "content": "and three?"}]


async def test_ctrl_c_ends_an_answer_not_the_app(model):
    """At 80x24: ctrl+c mid-answer ends it ([stopped]), the chat goes on; escape then goes back."""
    app = ChatHost(model)
    async with app.run_test(size=NARROW) as pilot:
        screen = await ready(pilot)
        screen.query_one("#max-new-tokens").value = "4000"
        screen.query_one("#prompt").focus()
        await pilot.press(*"tell me a long story", "enter")
        await wait_for(pilot, lambda: len(screen.chat.turns[0].answers[W.RUN].text) > 2, timeout=LOAD_S,
                       what="the answer streaming")
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not screen.chat.answering(), timeout=LOAD_S, what="the stop")
        answer = screen.chat.turns[0].answers[W.RUN]
        assert answer.stopped and not answer.error and app.is_running and app.screen is screen
        assert "[stopped]" in str(screen.query_one("#log-run").render())
        await say(pilot, screen, "hi", 3)
        assert screen.chat.turns[1].answers[W.RUN].done and not screen.chat.turns[1].answers[W.RUN].stopped
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, ChatScreen))
        assert app.is_running


async def open_runs(pilot: Any, rows: int) -> Any:
    """ctrl+l from the setup screen, once the runs screen lists `rows` runs."""
    app = pilot.app
    await machine_known(pilot)
    await pilot.press("ctrl+l")
    await wait_for(pilot, lambda: type(app.screen).__name__ == "RunsScreen"
                   and app.screen.query_one("DataTable").row_count == rows)
    return app.screen


def console_on(root: Path) -> Any:
    from shardconsole.console.app import ShardConsoleApp
    return ShardConsoleApp(FakeLauncher(root), FakeProbes(gpus=TWO_GPUS), preset="tiny-cpu", planner=fixed_planner)


async def test_t_on_the_runs_screen_chats_with_a_finished_run_only(tmp_path):
    """`t` on a running run says why not; on a finished one that kept no checkpoint it says so in one
    line, opens nothing, and the runs list stays."""
    root = tmp_path / "runs"
    write_run(root / "20260101-000001-done", gpus=0, device="cpu", steps=3, total_steps=3, finished=True)
    write_run(root / "20260101-000002-live", gpus=0, device="cpu", steps=2, total_steps=9)
    app = console_on(root)
    async with app.run_test(size=WIDE) as pilot:
        runs = await open_runs(pilot, 2)
        live = next(i for i, r in enumerate(runs.runs) if r.run_id.endswith("live"))
        runs.query_one("DataTable").move_cursor(row=live)
        await pilot.press("t")
        assert app.screen is runs
        assert "chat with a finished or stopped run" in str(list(app._notifications)[-1].message)
        runs.query_one("DataTable").move_cursor(row=1 - live)
        await pilot.press("t")
        notes = [str(n.message) for n in app._notifications]
        assert "no complete checkpoint left in" in notes[-1] and "nothing to chat with" in notes[-1], notes
        assert len(notes[-1].splitlines()) == 1 and app.screen is runs


def _copy_run(fsdp_chat_run: Any, root: Path, name: str) -> Path:
    """The shared run under a runs root of this test's (the tests change its checkpoint folder)."""
    run = root / name
    shutil.copytree(fsdp_chat_run.run, run)
    return run


async def test_t_on_a_run_without_a_tokenizer_says_so_before_any_step_or_export(fsdp_tiny_run, tmp_path):
    """conftest's tiny-cpu run (a catalog size on token ids, its final checkpoint kept): one line that
    there is no tokenizer, no step list, no chat screen exporting a checkpoint only to fail."""
    root = tmp_path / "runs"
    _copy_run(fsdp_tiny_run, root, "20260101-000003-tiny")
    app = console_on(root)
    async with app.run_test(size=WIDE) as pilot:
        runs = await open_runs(pilot, 1)
        await pilot.press("t")
        notes = [str(n.message) for n in app._notifications]
        assert notes and "there is no tokenizer to turn a message into tokens" in notes[-1], notes
        assert "catalog size 'tiny'" in notes[-1] and app.screen is runs


def _step(run: Path, n: int) -> Path:
    return run / "checkpoints" / f"step_{n:08d}"


async def test_t_picks_the_checkpoint_step_to_chat_with(fsdp_chat_run, tmp_path):
    """A run that kept steps 2 and 4: `t` lists both (newest first and highlighted), never a .partial
    save or a cut-short copy; down and enter chat with step 2, the chat child exports step 2 and says so."""
    from shardconsole.console.screens.dialogs import StepPickScreen
    run = _copy_run(fsdp_chat_run, tmp_path / "runs", "20260101-000001-two-steps")
    shutil.copytree(_step(run, 4), run / "checkpoints" / "step_00000006.partial")     # a save killed midway
    cut = shutil.copytree(_step(run, 2), _step(run, 3))                                # a copy cut short
    (biggest := max((f for f in cut.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)).write_bytes(
        biggest.read_bytes()[:10])
    app = console_on(tmp_path / "runs")
    async with app.run_test(size=NARROW) as pilot:
        runs = await open_runs(pilot, 1)
        await pilot.press("t")
        await wait_for(pilot, lambda: isinstance(app.screen, StepPickScreen), what="the step chooser")
        steps = app.screen.query_one("#steps")
        assert [o.id for o in steps.options] == ["4", "2"] and steps.highlighted == 0 and steps.has_focus
        await pilot.press("escape")                  # back to the runs list, nothing opened
        await wait_for(pilot, lambda: app.screen is runs, what="the runs list")
        await pilot.press("t")
        await wait_for(pilot, lambda: isinstance(app.screen, StepPickScreen), what="the step chooser again")
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen), what="the chat")
        chat = app.screen
        assert "Chat with 20260101-000001-two-steps, step 2" in str(chat.query_one("#chat-title").render())
        assert chat.client.argv()[-2:] == ["--step", "2"]
        await ready(pilot)
        # The child's own word for what it exported and loaded, in the status line under the title.
        assert chat.names[W.RUN] == "20260101-000001-two-steps, step 2"
        assert str(chat.query_one("#chat-status").render()).startswith("20260101-000001-two-steps, step 2 on cpu")


async def test_t_with_one_checkpoint_opens_the_chat_at_once(fsdp_chat_run, tmp_path):
    """Step 2 pruned: `t` opens the chat with the one left (step 4), no chooser in between."""
    from shardconsole.console.screens.dialogs import StepPickScreen
    run = _copy_run(fsdp_chat_run, tmp_path / "runs", "20260101-000001-one-step")
    shutil.rmtree(_step(run, 2))
    app = console_on(tmp_path / "runs")
    async with app.run_test(size=WIDE) as pilot:
        runs = await open_runs(pilot, 1)
        await pilot.press("t")
        # a chooser would stay until a key picks a step: the chat on top of the runs list means none came
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen), what="the chat")
        assert app.screen_stack[-2] is runs and not any(isinstance(s, StepPickScreen) for s in app.screen_stack)
        assert "one-step, step 4" in str(app.screen.query_one("#chat-title").render())
        assert app.screen.client.argv()[-2:] == ["--step", "4"]


def test_headless_chat_with_the_base_beside(model, base):
    out = shardconsole("chat", str(model), "--prompt", "hello there", "--max-new-tokens", "12", "--device", "cpu",
                       "--base", str(base))
    assert out.returncode == 0, out.stderr
    assert out.stdout == (f"model> {_reference(model, 'hello there', 12)}\n"
                          f"base> {_reference(base, 'hello there', 12)}\n")
    none = shardconsole("chat", str(model), "--prompt", "hi", "--base")
    assert none.returncode == 2 and "does not say which run it came from" in none.stderr
    assert "Traceback" not in none.stderr


# --- the looks ------------------------------------------------------------------------------------

@pytest.fixture
def model_here(model, tmp_path, monkeypatch) -> Path:
    """The model folder as ./model, so nothing on screen names the machine's temporary folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").symlink_to(model)
    return Path("model")


def chatted(text: str, max_new_tokens: int, with_base: bool = False) -> Any:
    async def run_before(pilot: Any) -> None:
        screen = await ready(pilot)
        if with_base:
            await pilot.press("ctrl+b")
            await ready(pilot, W.BASE)
        await say(pilot, screen, text, max_new_tokens)
        await still(pilot)
    return run_before


def test_chat_with_the_base_at_120x40(snap_compare, model_here, base):
    assert snap_compare(ChatHost(model_here, base), terminal_size=WIDE,
                        run_before=chatted("what is two plus two?", 24, with_base=True))


def test_chat_at_80x24(snap_compare, model_here):
    assert snap_compare(ChatHost(model_here), terminal_size=NARROW, run_before=chatted("hello", 16))


@pytest.mark.parametrize("size", [WIDE, NARROW], ids=["120x40", "80x24"])
def test_data_preview(snap_compare, monkeypatch, tmp_path, size):
    """ctrl+d on the setup screen's data tab (its key in the footer), the preview drawn from a frozen answer."""
    from shardconsole.console import tryout
    from tests.test_console import show_table
    from tests.test_console_snapshots import setup_app
    sample = json.loads((Path(__file__).parent / "data" / "preview_sample.json").read_text())
    monkeypatch.setattr(tryout, "preview", lambda cfg, records=3: (tryout._title(sample), tryout._body(sample)))
    monkeypatch.chdir(tmp_path)

    async def run_before(pilot: Any) -> None:
        await machine_known(pilot)
        await show_table(pilot, pilot.app.setup_screen, "data")
        await pilot.press("ctrl+d")
        await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "ReportScreen")
        pilot.app.clear_notifications()      # "tokenizing ..." goes after a few seconds: not part of the look
        await still(pilot)
    assert snap_compare(setup_app(), terminal_size=size, run_before=run_before)


# --- pure parts -----------------------------------------------------------------------------------

def test_the_base_of_a_run_is_its_model_folder_or_said_to_be_none(base, tmp_path):
    from shardconsole.tryout import base as B
    assert B.of_preset(f'[model]\nname = "{base}"\n', "preset.toml").folder == base.resolve()
    random = B.of_preset('[model]\nname = "tiny"\n', "preset.toml")
    assert random.folder is None and "random init" in random.why
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "config.json").write_text((base / "config.json").read_text())
    shapes = B.of_preset(f'[model]\nname = "{tmp_path / "shapes"}"\n', "preset.toml")
    assert shapes.folder is None and "no weights" in shapes.why
    # an export names its run's preset in its README (both exports write this block)
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "README.md").write_text(
        f"# x\n\n## The run's settings (its preset.toml)\n\n```toml\n[model]\nname = \"{base}\"\n```\n")
    assert B.of_export(tmp_path / "export").folder == base.resolve()


def test_weights_that_fit_nowhere_are_refused_in_one_line():
    from shardconsole.settings import config as C
    from shardconsole.tryout.chat import pick_device
    with pytest.raises(C.ConfigError, match=r"^chat: the weights take .* GiB in bf16 .* no GPU or host RAM here"):
        pick_device(1 << 50)
