"""SimPO and KTO with real 2-rank CPU runs (issue 66): both engines across the two objectives, full fine-tuning
and LoRA sampled (SimPO with FSDP2 full; KTO with DeepSpeed ZeRO-3 full, its reference the starting weights'
table, and with FSDP2 LoRA, its reference the base with the adapters off), on a model folder and records made
here: the desirable answer follows a rule (a kind word after "It is"), the undesirable one breaks it.

Each run: 6 steps, an eval of the held-out records every 2. Checked: the held-out reward margin grows between
the first and the last eval (SimPO: the chosen minus the rejected reward of each pair; KTO: the mean reward of
the desirable records minus that of the undesirable ones); the figures reach the step lines, the headless
lines and TensorBoard; the eval loss is finite; `shardconsole data` shows the records as they train.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from test_preference_runs import _sets, assert_tensorboard_has_the_figures, folder, preference_records  # noqa: F401

from tests.conftest import messages, of_kind, shardconsole

RUN_TIMEOUT = 600
COMMON = ["data.seq_len=64", "data.eval_fraction=0.25", "train.eval_every=2", "train.steps=6", "train.log_every=1",
          "train.micro_batch=2", "train.warmup_steps=0"]
RUNS = {
    "simpo-fsdp-full": ["train.objective=simpo", "train.lr=3e-4", "preference.beta=2.0", "preference.cpo_alpha=0"],
    "kto-zero3-full": ["train.objective=kto", "train.lr=3e-4", "parallel.backend=deepspeed", "deepspeed.stage=3"],
    "kto-fsdp-lora": ["train.objective=kto", "train.method=lora", "lora.rank=8", "train.lr=3e-3"],
}


def kto_records(n: int, seed: int = 0) -> list[dict]:
    """TRL's unpaired form, from the pairs: each pair's chosen answer labelled true, its rejected one false."""
    out = []
    for r in preference_records(n // 2, seed):
        out.append({"prompt": r["prompt"], "completion": r["chosen"], "label": True})
        out.append({"prompt": r["prompt"], "completion": r["rejected"], "label": False})
    return out


@pytest.fixture(scope="module")
def data(folder):
    kto = folder.root / "kto.jsonl"
    kto.write_text("".join(json.dumps(r) + "\n" for r in kto_records(96)))
    return {"simpo": folder.data, "kto": kto}


@pytest.fixture(scope="module", params=list(RUNS))
def run(folder, data, request):
    name = request.param
    objective = name.split("-")[0]
    out = folder.root / name
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(out),
                       *_sets(f"model.name={folder.model}", f"data.path={data[objective]}", *COMMON, *RUNS[name]),
                       timeout=RUN_TIMEOUT, env=folder.env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return SimpleNamespace(name=name, objective=objective, dir=out, stdout=res.stdout, msgs=messages(out))


def test_the_margin_grows_and_the_figures_reach_every_view(run):
    steps = of_kind(run.msgs, "step")
    assert [s.step for s in steps] == list(range(1, 7))
    evals = of_kind(run.msgs, "eval")
    assert [e.step for e in evals] == [2, 4, 6]
    assert all(math.isfinite(e.loss) and e.pairs > 0 for e in evals), evals
    margins = [e.reward_margin for e in evals]
    assert margins[-1] > margins[0], (run.name, margins)
    last = run.stdout.split("step 6/6")[1].splitlines()[0]
    if run.objective == "kto":
        assert all(s.kl is not None and s.kl >= 0 and s.pref_accuracy is None for s in steps)
        assert all(e.kl is not None and e.reward_chosen is not None and e.reward_rejected is not None for e in evals)
        assert " kl " in last and "margin" in last, last
        assert "KTO records (" in run.stdout and " records, " in run.stdout.split("eval step 6")[1].splitlines()[0]
        data = next(line for line in run.stdout.splitlines() if line.startswith("data: "))
        assert "(kto)" in data and " records (" in data and " desirable, " in data and " pair" not in data, data
    else:
        assert all(s.kl is None and s.pref_accuracy is not None for s in steps)
        assert " acc " in last, last
    infos = [m.detail for m in of_kind(run.msgs, "event") if m.name == "info" and "reference log-probs" in m.detail]
    assert bool(infos) == run.name.endswith("zero3-full"), infos     # KTO full: the starting weights' table
    assert_tensorboard_has_the_figures(run.dir, kto=run.objective == "kto")


def test_data_preview_shows_kto_records(folder, data):
    res = shardconsole("data", "--set", f"model.name={folder.model}", "--set", f"data.path={data['kto']}",
                       "--set", "train.objective=kto", "--set", "data.seq_len=64", "--preview", "2", "--plain",
                       env=folder.env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "desirable" in res.stdout and "undesirable" in res.stdout and "It is" in res.stdout, res.stdout


@pytest.mark.parametrize("records, says", [
    ([{"prompt": "a", "completion": "b"}], "field 'label': missing"),
    ([{"prompt": "a", "completion": "b", "label": True}] * 3, "all 3 records read are true"),
    ([{"prompt": "a", "completion": "b", "label": "yes"}], "field 'label': got str yes; expected true or false"),
    ([{"prompt": "a", "completion": "", "label": False}], "field 'completion': empty answer"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], "field 'label': missing"),
])
def test_bad_kto_records_are_one_line_before_launch(folder, tmp_path, records, says):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"),
                       *_sets(f"model.name={folder.model}", f"data.path={bad}", "train.objective=kto"),
                       timeout=120, env=folder.env)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and says in lines[0] and "data.path" in lines[0], res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()


def test_kto_rows_pair_each_prompt_with_the_previous_completion(tmp_path):
    """The cache's KTO rows: record j's row is its prompt and completion, its KL row its prompt and the
    completion of record j - 1 (record 0: the last one's), TRL's +1 rotation; labels kept per record."""
    import numpy as np

    from shardconsole.backends.data import preference as pairs_data
    from shardconsole.backends.data.pair_tokens import PairTokens
    writer = pairs_data._KtoWriter(tmp_path, "train", np.dtype(np.uint16), 16)
    records = [([1, 2], [10, 11, 12], True), ([3], [20], False), ([4, 5, 6], [30, 31], True)]
    for prompt, completion, label in records:
        writer.add(PairTokens(prompt, completion, completion, label))
    info = writer.close()
    assert (info["records"], info["desirable"]) == (3, 2)
    split = pairs_data.PairSplit(np.fromfile(tmp_path / "train.ids", dtype=np.uint16),
                                 np.fromfile(tmp_path / "train.index", dtype=np.int64).reshape(-1, 4),
                                 np.fromfile(tmp_path / "train.labels", dtype=np.uint8).astype(bool))
    ids, labels = pairs_data.rows(split, [0, 1, 2], 16)
    for j, (prompt, completion, _) in enumerate(records):
        kl_completion = records[j - 1][1]
        assert ids[j, :len(prompt) + len(completion)].tolist() == prompt + completion
        assert ids[3 + j, :len(prompt) + len(kl_completion)].tolist() == prompt + kl_completion
        assert labels[3 + j, len(prompt) - 1:len(prompt) - 1 + len(kl_completion)].tolist() == kl_completion
    assert split.labels.tolist() == [True, False, True]
