"""Several data sources in one run, mixed by weight (issue 66 item 2): the rows each source gives, counted
by their content (each source's text is its own letter); bad input refused before launch in one line;
real 2-rank runs whose data line and checkpoint say each source's share, and whose resume after a failure
sees the rows the uninterrupted run saw (its losses to 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import messages, of_kind, shardconsole
from shardconsole.backends.data import mixture
from shardconsole.settings import config as C
from shardconsole.settings import data_mix

SEQ = 32


def letters(path: Path, letter: str, n: int, length: int = 60) -> Path:
    """n records of one letter repeated: every byte of a window from this file is that letter or EOS."""
    path.write_text("".join(json.dumps({"text": letter * (length + i % 7)}) + "\n" for i in range(n)))
    return path


def mix_of(tmp_path: Path, weights: str, seed: int = 1234, n_b: int = 40) -> mixture.MixedWindows:
    a, b = letters(tmp_path / "a.jsonl", "a", 80), letters(tmp_path / "b.jsonl", "b", n_b)
    cfg = C.build(overrides=[f"data.path={a},{b}", f"data.weights={weights}", f"data.seq_len={SEQ}",
                             "data.tokenizer=bytes", f"train.seed={seed}"])
    entry = mixture.open_mix(cfg, 384, None, False, lambda s: None)
    return mixture.source_of(cfg, entry, rank=0, world=1)


def tokens_by_letter(ids: np.ndarray) -> tuple[int, int]:
    """(windows of only 'a' text, of only 'b' text): the oracle, read from the bytes, not the schedule."""
    a = b = 0
    for row in ids:
        text = bytes(int(t) for t in row if 32 <= t < 127)
        assert set(text) <= {ord("a")} or set(text) <= {ord("b")}, text     # a row never mixes sources
        a += set(text) == {ord("a")}
        b += set(text) == {ord("b")}
    return a * SEQ, b * SEQ


def test_three_to_one_gives_three_times_the_tokens_reproducibly(tmp_path):
    src = mix_of(tmp_path, "3,1")
    ids, _ = src.windows(400)
    assert tokens_by_letter(ids) == (300 * SEQ, 100 * SEQ)                # 100 whole blocks: exact
    assert src.positions(400) == [300, 100]
    again = mix_of(tmp_path, "3,1")
    assert np.array_equal(again.windows(400)[0], ids)                    # the same rows for the seed
    other = mix_of(tmp_path, "3,1", seed=7)
    part, _ = other.windows(401)
    assert not np.array_equal(part[:400], ids)                            # another seed, another order
    a, b = tokens_by_letter(part)
    assert abs(a / SEQ - 401 * 0.75) <= 1 and a + b == 401 * SEQ           # mid-block: within one row


def test_a_source_that_runs_out_starts_another_epoch_of_its_own(tmp_path):
    src = mix_of(tmp_path, "1,1", n_b=8)
    n_b = src.sizes[1]
    rows = [src.locate(g) for g in range(40 * n_b)]
    of_b = [src.window(k, i) for k, i in rows if k == 1]
    assert len(of_b) == 20 * n_b                                          # the share held: half the rows
    for e in range(20):                                                   # each epoch: every window once
        assert sorted(of_b[e * n_b:(e + 1) * n_b]) == list(range(n_b))
    assert of_b[:n_b] != of_b[n_b:2 * n_b]                                 # reshuffled per epoch


def test_seek_puts_each_source_where_the_uninterrupted_run_was(tmp_path):
    whole = mix_of(tmp_path, "3,1", n_b=8)
    first = whole.windows(50)[0]
    rest = whole.windows(37)[0]
    resumed = mix_of(tmp_path, "3,1", n_b=8)
    resumed.seek(50)
    assert np.array_equal(resumed.windows(37)[0], rest) and not np.array_equal(first[:37], rest)


def test_weights_as_a_toml_list_or_with_set(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('[data]\npath = ["x.jsonl", "y.jsonl"]\nweights = [3, 1.5]\n')
    cfg = C.load(f)
    assert data_mix.paths(cfg.data) == ["x.jsonl", "y.jsonl"] and data_mix.weights(cfg.data) == [3.0, 1.5]
    assert data_mix.quota([3.0, 1.5]) == ([2, 1], 3)
    assert data_mix.quota([0.7, 0.3]) == ([7, 3], 10)
    assert C.build(overrides=["data.path=x.jsonl,y.jsonl", "data.weights=3,1.5"]).data.weights == "3,1.5"


@pytest.mark.parametrize("sets, line", [
    (["data.weights=3,0"], "--set data.weights: 0 is not above 0; each source's weight must be a positive "
                           "number (drop a source from data.path instead of weighting it 0)"),
    (["data.weights=3,-1"], "--set data.weights: -1 is not above 0"),
    (["data.weights=3,x"], "--set data.weights: 'x' is not a number; one positive number per source of data.path"),
    (["data.weights=3,1,1"], "--set data.weights: has 3 weight(s) but data.path names 2 source(s)"),
    (["data.eval_path=E"], "--set data.eval_path: holds one eval set, but data.path names several sources"),
])
def test_bad_weights_are_refused_before_launch_in_one_line(tmp_path, sets, line):
    a, b = letters(tmp_path / "a.jsonl", "a", 10), letters(tmp_path / "b.jsonl", "b", 10)
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"),
                       "--set", f"data.path={a},{b}", *[x for s in sets for x in ("--set", s)])
    assert res.returncode == 2
    [got] = res.stderr.strip().splitlines()
    assert got.startswith(f"shardconsole: error: {line}"), got
    assert not (tmp_path / "run").exists()


def test_an_unknown_source_is_refused_before_launch_naming_it(tmp_path):
    a = letters(tmp_path / "a.jsonl", "a", 10)
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"),
                       "--set", f"data.path={a},{tmp_path}/nope.jsonl", "--set", "data.weights=3,1")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"shardconsole: error: --set data.path: {tmp_path}/nope.jsonl: no such file or folder"]


def losses(run: Path) -> dict[int, float]:
    return {m.step: m.loss for m in of_kind(messages(run), "step")}


def start(run: Path, a: Path, b: Path, *sets: str, env: dict | None = None):
    common = ["precision.dtype=fp32", "train.steps=6", "train.log_every=1", "train.checkpoint_every=2", f"data.path={a},{b}",
              "data.weights=3,1", f"data.seq_len={SEQ}", "data.eval_fraction=0.2", "train.eval_every=3"]
    return shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                        *[x for s in (*common, *sets) for x in ("--set", s)], timeout=600, env=env)


@pytest.mark.slow
def test_a_mixed_run_reports_each_source_and_resumes_exactly(tmp_path):
    a, b = letters(tmp_path / "a.jsonl", "a", 60), letters(tmp_path / "b.jsonl", "b", 5)
    ref, run = tmp_path / "reference", tmp_path / "interrupted"
    res = start(ref, a, b)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    [data] = of_kind(messages(ref), "data")
    rows = 6 * 8                                       # tiny-cpu: 8 samples a step over its 2 ranks
    assert data.sources == (str(a), str(b)) and data.source_shares == (0.75, 0.25)
    assert data.source_tokens == (rows * 3 // 4 * SEQ, rows // 4 * SEQ)
    assert data.source_epochs[1] > 1                   # b runs out and starts again within the run
    assert f"source {b}: 25.0% of the rows, {rows // 4 * SEQ:,} tokens, {data.source_epochs[1]:.2f} epochs" \
        in res.stdout
    evals = of_kind(messages(ref), "eval")
    assert [e.sources for e in evals] == [("a.jsonl", "b.jsonl")] * 2 and all(len(e.source_losses) == 2 for e in evals)
    assert "; a.jsonl " in res.stdout and "; b.jsonl " in res.stdout           # the headless eval line
    manifest = json.loads((ref / "checkpoints" / "step_00000004" / "shardconsole.json").read_text())
    assert [s["samples"] for s in manifest["data"]["sources"]] == [24, 8]

    res = start(run, a, b, env={"SHARDCONSOLE_FAULT": "raise@rank=0,step=5"})
    assert res.returncode != 0 and sorted(losses(run)) == [1, 2, 3, 4]
    res = shardconsole("resume", str(run), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert losses(run) == pytest.approx(losses(ref), abs=1e-5), (losses(run), losses(ref))
    assert "data: resumed each source at " in res.stdout

    res = shardconsole("resume", str(run), "--set", "train.steps=8", "--set", "data.weights=1,1", timeout=600)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "shardconsole: error: --set data.weights: 1, 1: step_00000006 was trained with 3, 1; keep them to resume "
        "the mix where it was, or --set data.allow_changed=true to go on from the start of an epoch of the new data"]


def test_the_preview_gives_each_sources_share_and_epochs(tmp_path):
    a, b = letters(tmp_path / "a.jsonl", "a", 40), letters(tmp_path / "b.jsonl", "b", 10)
    res = shardconsole("data", "--preview", "1", "--json", "--preset", "tiny-cpu", "--set", f"data.path={a},{b}",
                       "--set", "data.weights=3,1", "--set", f"data.seq_len={SEQ}", "--set", "train.steps=10")
    assert res.returncode == 0, res.stderr
    views = json.loads(res.stdout)["sources"]
    # the oracle: UTF-8 bytes, each record's text and its EOS, packed into windows of SEQ + 1 tokens
    windows = [(sum(len(json.loads(line)["text"]) + 1 for line in p.read_text().splitlines()) - 1) // SEQ
               for p in (a, b)]
    rows = 10 * 8
    assert [(v["path"], v["share"], v["samples"], v["rows"]) for v in views] == [
        (str(a), 0.75, windows[0], rows * 3 // 4), (str(b), 0.25, windows[1], rows // 4)]
    assert [v["epochs"] for v in views] == [round(rows * 3 / 4 / windows[0], 3), round(rows / 4 / windows[1], 3)]
    assert [v["preview"]["records"][0]["tokens"] for v in views] == [61, 61]


def test_the_consoles_log_gives_each_sources_share_and_eval_loss():
    from shardconsole.console.runview import log_line
    from shardconsole.runlog import protocol as P
    data = P.DataSummary(source="/x/a.jsonl, /x/b.jsonl", format="text", records=3, samples=4,
                         sources=("/x/a.jsonl", "/x/b.jsonl"), source_shares=(0.75, 0.25), source_epochs=(1.0, 2.5))
    assert log_line(P.decode(P.encode(data))).endswith("; a.jsonl 75.0% of rows, 1.00 epochs; b.jsonl 25.0% of rows, "
                                                       "2.50 epochs")
    ev = P.Eval(step=3, loss=1.0, tokens=5, sources=("a.jsonl", "b.jsonl"), source_losses=(0.9, 1.3))
    assert log_line(P.decode(P.encode(ev))).endswith("(5 tokens, 0.0 s); a.jsonl 0.9000; b.jsonl 1.3000")


def test_a_save_to_disk_folder_mixes_with_a_file(tmp_path):
    import datasets
    a = letters(tmp_path / "a.jsonl", "a", 40)
    datasets.Dataset.from_list([{"text": "b" * 60} for _ in range(20)]).save_to_disk(str(tmp_path / "b"))
    cfg = C.build(overrides=[f"data.path={a},{tmp_path / 'b'}", "data.weights=1,1", f"data.seq_len={SEQ}",
                             "data.tokenizer=bytes"])
    src = mixture.source_of(cfg, mixture.open_mix(cfg, 384, None, False, lambda s: None), rank=0, world=1)
    assert tokens_by_letter(src.windows(200)[0]) == (100 * SEQ, 100 * SEQ)
