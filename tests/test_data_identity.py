"""The data a run was trained on (issue 31 item 7): a checkpoint records its content hash, record count
and token-cache key; a resume on other data refuses in one line (data.allow_changed goes on, from the
start of an epoch of the new data); the token cache never serves the tokens of an older version of a
file that kept its size and mtime."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import messages, of_kind, shardconsole
from shardconsole.backends.data import token_cache
from shardconsole.settings import config as C


def records(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"text": f"record number {i}: the quick brown fox."}) + "\n"
                   for i in range(start, start + n))


def test_an_edit_that_keeps_size_and_mtime_gets_new_tokens(tmp_path, monkeypatch):
    """`cp -p` of an edited file (same size, the old mtime put back; here on the same inode, as cp -p
    over an existing file does) must not be served from the cache under the old content's key."""
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "notes.txt"
    f.write_text("aaaa\n\nbbbb\n")
    d = C.DataSettings(path=str(f))
    first = token_cache.open_entry(d, 1, None, False, 512, lambda s: None)
    st = f.stat()
    edited = tmp_path / "edited.txt"
    edited.write_text("aaaa\n\ncccc\n")
    shutil.copystat(f, edited)
    with f.open("r+") as fh:           # same inode, same size
        fh.write(edited.read_text())
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns, f.stat().st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    second = token_cache.open_entry(d, 1, None, False, 512, lambda s: None)
    assert second.built_here and second.folder != first.folder
    ids = np.asarray(second.train.ids).tolist()           # UTF-8 bytes: the edited text, not the old
    assert ord("c") in ids and ord("b") not in ids


def test_a_checkpoint_of_before_the_bytes_hash_still_compares_its_content(tmp_path, monkeypatch):
    """Checkpoints written before a file's hash was its bytes alone hashed its name too (and carry no
    "hashed"): a resume on the same file compares it that way, so it is not refused as changed content."""
    from shardconsole.backends.data import batches
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "d.jsonl"
    f.write_text(records(5))
    now = {"path": str(f), "sha256": token_cache.content_hash(f), "hashed": batches.HASHED}
    assert now["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
    old = {"path": str(f), "sha256": token_cache.named_content_hash(f)}
    assert old["sha256"] != now["sha256"] and batches._same_content(old, now)
    assert not batches._same_content({**old, "hashed": batches.HASHED}, now)
    f.write_text(records(6))
    assert not batches._same_content(old, {**now, "sha256": token_cache.content_hash(f)})


@pytest.mark.slow
def test_a_resume_on_changed_data_refuses_in_one_line(tmp_path):
    """A run on 40 records checkpoints; a byte-identical copy elsewhere resumes it; 400 records are appended;
    the resume refuses naming what changed and data.allow_changed; with it the run goes on from an epoch
    start of the new data."""
    data = tmp_path / "d.jsonl"
    data.write_text(records(40))
    run = tmp_path / "run"
    env = {"SHARDCONSOLE_CACHE_DIR": str(tmp_path / "cache")}
    base = ["--set", "train.steps=2", "--set", "data.seq_len=32", "--set", f"data.path={data}"]
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), *base, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    manifest = json.loads((ckpt / "shardconsole.json").read_text())
    assert manifest["data"]["records"] == 40 and len(manifest["data"]["sha256"]) == 64
    assert manifest["data"]["cache_key"]
    # The same bytes under another name and folder (the original gone) are the same data: the resume
    # goes on, with one note (the manifest's sha256 is the file's own, as sha256sum says).
    assert manifest["data"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    moved = tmp_path / "elsewhere" / "copy-of-d.jsonl"
    moved.parent.mkdir()
    shutil.copyfile(data, moved)
    data.unlink()
    res = shardconsole("resume", str(run), "--set", "train.steps=3", "--set", f"data.path={moved}", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    notes = [m.detail for m in of_kind(messages(run), "event") if "the same content as" in m.detail]
    assert notes == [f"data: {moved}: the same content as {data}, which {ckpt.name} trained on"], notes
    assert max(m.step for m in of_kind(messages(run), "step")) == 3
    ckpt, data = sorted((run / "checkpoints").glob("step_*"))[-1], moved
    with data.open("a") as fh:
        fh.write(records(400, 40))
    res = shardconsole("resume", str(run), "--set", "train.steps=4", env=env)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if "data.allow_changed" in ln]
    assert len(lines) == 1 and "400 record(s) added" in lines[0] and str(data) in lines[0], res.stderr[-2000:]
    assert max(m.step for m in of_kind(messages(run), "step")) == 3       # nothing trained on the new data
    res = shardconsole("resume", str(run), "--set", "train.steps=4", "--set", "data.allow_changed=true", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    msgs = messages(run)
    warned = [m for m in of_kind(msgs, "event") if m.name == "warning" and "data.allow_changed" in m.detail]
    assert len(warned) == 1 and "400 record(s) added" in warned[0].detail
    assert max(m.step for m in of_kind(msgs, "step")) == 4
