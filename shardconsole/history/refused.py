"""A resume the ranks refused before its first step is no end of the run (issue 65 item 4).

Some refusals only the ranks can make, once launched (a token cache entry damaged since, a checkpoint whose
bytes do not load, a tokenizer that no longer loads): the resumed session then ends `failed (config_error)`
without having trained a step or written a save, and the folder read `failed` over a run that had finished.
Nothing of the run changed, so its status stays the end its earlier session wrote; the refusal is said
beside it. A session that trained or saved before failing is a failure of the run as before.
"""

from __future__ import annotations

import dataclasses

from shardconsole.runlog import protocol as P
from shardconsole.runlog.runstate import RunState


class SessionEnds:
    """Folded beside a RunState, line by line: the end before this session, and whether this session was a
    refusal (a config_error before any step line or save)."""

    def __init__(self) -> None:
        self.ended: tuple[P.Finished | None, list[P.Failed]] | None = None
        self.moved = False
        self.refused: P.Failed | None = None

    def new_session(self, state: RunState) -> None:
        """Called before the state forgets the session that ends here."""
        if self.refused is None:        # a refused session never replaces the end before it
            ended = state.finished is not None or bool(state.failed)
            self.ended = (state.finished, list(state.failed)) if ended else None
        self.moved, self.refused = False, None

    def saw(self, msg: P.Message) -> None:
        if isinstance(msg, P.Step) or (isinstance(msg, P.Event) and msg.name == "checkpoint_saved"):
            self.moved = True
        elif (isinstance(msg, P.Failed) and msg.cause == "config_error" and not self.moved
              and self.ended is not None and self.refused is None):
            self.refused = msg

    def view(self, state: RunState) -> RunState:
        """The state whose end is the run's: the earlier session's after a refused resume."""
        if self.refused is None or self.ended is None:
            return state
        finished, failed = self.ended
        return dataclasses.replace(state, finished=finished, failed=list(failed))

    def note(self) -> str:
        f = self.refused
        if f is None:
            return ""
        return (f"; a resume was refused before its first step: {f.exc_type + ': ' if f.exc_type else ''}"
                f"{f.message.splitlines()[0] if f.message else ''}")


def _end_words(finished: P.Finished | None, failed: list[P.Failed]) -> str:
    if finished is not None and not failed:
        return f"finished at step {finished.steps}"
    f = RunState(failed=list(failed)).first_failure()
    if f is None:
        return "ended"
    return f"stopped at step {f.step}" if f.cause == "stopped" else f"failed ({f.cause})"


def refusal_line(run_dir) -> str:
    """The one line a resume refused by its ranks ends with (its front end says it in place of a failure
    paragraph), when the stream's last session is such a refusal; "" otherwise."""
    from shardconsole.runlog.runfolder import RunFolder
    from shardconsole.runlog.stream import MetricsReader
    reader = MetricsReader(RunFolder(run_dir).metrics)
    state, ends, session = RunState(), SessionEnds(), ""
    try:
        while batch := reader.poll():
            for msg in batch:
                if isinstance(msg, P.Hello) and msg.run != session:
                    if session:
                        ends.new_session(state)
                        state.new_session()
                    session = msg.run
                if isinstance(msg, (P.Finished, P.Failed)) and session and msg.run and msg.run != session:
                    continue        # as the fold: an end line of another session is not this one's
                state.apply(msg)
                ends.saw(msg)
    finally:
        reader.close()
    f = ends.refused
    if f is None or ends.ended is None:
        return ""
    return (f"resume refused on rank {f.rank} before its first step: {f.exc_type + ': ' if f.exc_type else ''}"
            f"{f.message.splitlines()[0] if f.message else ''}" + (f"; try: {f.hint}" if f.hint else "")
            + f"; {run_dir} keeps its end and its settings: {_end_words(*ends.ended)}")


def put_back_settings(run_dir) -> None:
    """The settings the refused resume wrote go back to the run's own (the resume kept them as
    preset.toml.prev): the folder is as it was, as a resume refused before its launch leaves it."""
    import os
    from shardconsole.runlog.runfolder import RunFolder
    preset = RunFolder(run_dir).preset
    prev = preset.with_name(preset.name + ".prev")
    if prev.is_file():
        os.replace(prev, preset)
