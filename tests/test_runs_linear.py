"""`runs` and `compare` are linear in the step lines (issue 31 item 4): the fold keeps the loss curve
incrementally (a resume's replayed steps still replace the old points), and a run that is not in the
disk cache (running, or of unknown end) is folded on from where the last fold of this process stopped."""

from __future__ import annotations

import time
from pathlib import Path

from shardconsole.history import index, stream_fold
from shardconsole.runlog import protocol as P


def stream(folder: Path, steps: range, run: str = "r1", hello: bool = True) -> None:
    """A run folder (preset.toml; no job.json: started elsewhere, so no cache of an ended run applies)
    with a metrics.jsonl of step lines."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "preset.toml").touch()
    lines = [P.encode(P.Hello(run=run, rank=0, world=1))] if hello else []
    lines += [P.encode(P.Step(run=run, rank=0, step=i, steps=10**6, loss=1.0 / i, tokens_per_s=100.0 + i))
              for i in steps]
    with (folder / "metrics.jsonl").open("a") as fh:
        fh.write("\n".join(lines) + "\n")


def cpu_s(fn) -> float:
    best = float("inf")
    for _ in range(2):          # the least of two: the machine's other load only ever adds
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def test_the_fold_is_linear_in_the_step_lines(tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    stream(small, range(1, 5_001))
    stream(big, range(1, 50_001))
    # Each call folds from byte 0 (the kept fold dropped): the cost of a first `runs`.
    def fold(folder):
        def go():
            stream_fold._LIVE.clear()
            s = index.summarize(folder)
            assert len(s.loss) == s.step
        return go
    ratio = cpu_s(fold(big)) / cpu_s(fold(small))
    # 10x the lines: ~10x the work when linear; the per-line rebuild of the curve made it ~100x (5.4 s at
    # 10k steps, 23 s at 20k, past 10 minutes for a 459 MB stream).
    assert ratio < 30, ratio
    s = index.summarize(big)
    assert (s.step, s.loss[-1], s.last_loss) == (50_000, (50_000, 1.0 / 50_000), 1.0 / 50_000)


def test_a_resume_replays_steps_and_a_running_run_is_folded_on_from_its_offset(tmp_path):
    run = tmp_path / "run"
    stream(run, range(1, 1_001))
    stream_fold._LIVE.clear()
    before = stream_fold.FOLDED["lines"]
    assert index.summarize(run).step == 1_000
    assert stream_fold.FOLDED["lines"] - before == 1_001
    # A resume from step 800 appends a session of its own that replays 801..1200.
    stream(run, range(801, 1_201), run="r1-resume")
    before = stream_fold.FOLDED["lines"]
    s = index.summarize(run)
    assert stream_fold.FOLDED["lines"] - before == 401           # only the new lines, not the whole stream again
    assert [p[0] for p in s.loss] == list(range(1, 1_201))  # replayed steps replace, never duplicate
    assert s.loss[900] == (901, 1.0 / 901)
    # Asked again with nothing new: nothing read; the file replaced: read from the start.
    before = stream_fold.FOLDED["lines"]
    index.summarize(run)
    assert stream_fold.FOLDED["lines"] == before
    (run / "metrics.jsonl").unlink()
    stream(run, range(1, 11))
    assert index.summarize(run).step == 10 and stream_fold.FOLDED["lines"] - before == 11
