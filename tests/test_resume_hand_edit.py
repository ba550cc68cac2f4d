"""A setting the checkpoint's tensors depend on, changed under a resume by a hand edit of preset.toml
(issue 64, the sweep's changed inputs): the resume compared the overrides with preset.toml, so an edit of
the file itself was compared with itself, launched, loaded the adamw states into adamw8bit and crashed at
the first step. The save now records those settings in its manifest; the resume compares with them and
refuses in one line naming the file, and an override back to the saved value resumes. Real 2-rank runs."""

from __future__ import annotations

from tests.conftest import messages, of_kind, shardconsole


def test_a_hand_edited_optimizer_is_refused_against_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=2",
                       timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    preset = run / "preset.toml"
    text = preset.read_text()
    assert text.count('name = "adamw"\n') == 1, text
    preset.write_text(text.replace('name = "adamw"\n', 'name = "adamw8bit"\n'))
    edited = preset.read_bytes()

    res = shardconsole("resume", str(run), "--set", "train.steps=4", timeout=300)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert lines[0].startswith(f"shardconsole: error: {preset}: [optim] name: the checkpoints were saved with "
                               f"optim.name = 'adamw' (step_00000002's manifest)"), lines[0]
    assert preset.read_bytes() == edited and len(of_kind(messages(run), "hello")) == 2   # nothing launched

    res = shardconsole("resume", str(run), "--set", "train.steps=4", "--set", "optim.name=adamw", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert max(s.step for s in of_kind(messages(run), "step")) == 4
