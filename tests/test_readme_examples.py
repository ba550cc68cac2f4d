"""Every shell example of README.md and docs/*.md, run as a user types it: in a fresh folder per section
(docs/FINETUNE.md continues in the folder of README's fine-tune, as its text says), with the real
`shardconsole` on PATH, real 2-rank CPU runs, a real Hugging Face model folder and chats file. A command
that appears in several pages runs once.

An example that cannot run here is listed in NOT_AS_WRITTEN with the reason (a GPU, several nodes,
Slurm, the network, an interactive terminal, the suite's time) and what runs instead: its settings
resolved and its command printed, or the same command with fewer steps. An example (an indented block
of README.md or docs/*.md) that is neither runnable nor listed fails the first test, so a new example
cannot go untested.

Placeholders are filled as a user fills them, with the runs made so far (the Set-up example's, then the
Fine-tune section's): `<id>` (each one another run) and `<run folder>` by a run's folder, `[...]` options
typed (`[--json]` -> `--json`), N in `train.steps=N` as 40. Examples with a run placeholder run after the
others, as a user follows runs they have made.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from hf_fixtures import make_hf_model

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
# A page whose examples continue another page's folder (its text says so): page name -> (page, section).
CONTINUES = {"FINETUNE.md": ("README.md", "Fine-tune your model on your data")}

# README's test command: CI's (.ci/run) steps, one line (test_the_readme_test_command_is_what_ci_runs).
TEST_COMMAND = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e '.[test]' && "
                "DS_ACCELERATOR=cpu pytest -q -p no:cacheprovider")

# README example -> (why it does not run as written here, the commands the test runs instead).
NOT_AS_WRITTEN: dict[str, tuple[str, list[str]]] = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && "
    "shardconsole --preset tiny-cpu --headless": (
        "installs packages from the network into a new venv; its last command runs here as written",
        ["shardconsole --preset tiny-cpu --headless"]),
    TEST_COMMAND: ("installs packages from the network, then runs this very suite (.ci/run, checked against it "
                   "below)", []),
    "shardconsole": (
        "opens the interactive console (tests/test_console*.py drive it with Textual's pilot); the preset it "
        "opens, resolved and its command printed", ["shardconsole --print-command"]),
    "shardconsole --preset my.toml --headless --set train.steps=50 --set fsdp.cpu_offload=false": (
        "suite time: the headless path runs in the Set-up and Fine-tune examples; my.toml (the example "
        "before) resolved with the same overrides and its command printed",
        ["shardconsole --preset my.toml --print-command --set train.steps=50 --set fsdp.cpu_offload=false"]),
    "shardconsole --preset tiny-cpu --headless --run-dir runs/my-chat --set model.name=path/to/model "
    "--set data.path=chats.jsonl --set data.eval_fraction=0.1 --set train.steps=200 --set train.eval_every=50 "
    "--set train.checkpoint_every=50": (
        "suite time: 200 steps take 1-2 min on 2 shared cores; the same command with 20 steps, an eval and a "
        "checkpoint every 10",
        ["shardconsole --preset tiny-cpu --headless --run-dir runs/my-chat --set model.name=path/to/model "
         "--set data.path=chats.jsonl --set data.eval_fraction=0.1 --set train.steps=20 --set train.eval_every=10 "
         "--set train.checkpoint_every=10"]),
    "shardconsole resume <run folder> [--set train.steps=N]": (
        "the same command as the Fine-tune section's resume, which runs (one resume per suite)", []),
    "shardconsole export-model <run folder> -o my-model": (
        "the same command as the Fine-tune section's export-model, which runs (one export per suite)", []),
    "shardconsole resume runs/my-chat --set train.steps=400": (
        "suite time (see the run above): resumed to 40 steps", ["shardconsole resume runs/my-chat --set train.steps=40"]),
    "shardconsole --preset tiny-cpu --headless --run-dir runs/my-lora --set model.name=path/to/model "
    "--set data.path=chats.jsonl --set data.eval_fraction=0.1 --set train.method=lora --set lora.rank=16 "
    "--set train.steps=200 --set train.eval_every=50": (
        "suite time: the same LoRA run with 10 steps and an eval every 5",
        ["shardconsole --preset tiny-cpu --headless --run-dir runs/my-lora --set model.name=path/to/model "
         "--set data.path=chats.jsonl --set data.eval_fraction=0.1 --set train.method=lora --set lora.rank=16 "
         "--set train.steps=10 --set train.eval_every=5"]),
    "shardconsole chat runs/my-chat --step 50 --temperature 0.7 --top-p 0.9 --max-new-tokens 200": (
        "suite time (the run above has 20 steps): its checkpoint of step 20",
        ["shardconsole chat runs/my-chat --step 20 --temperature 0.7 --top-p 0.9 --max-new-tokens 200 < /dev/null"]),
    "shardconsole chat my-model": (
        "interactive: the same chat with its input at an end at once (Ctrl-D)", ["shardconsole chat my-model < /dev/null"]),
    "shardconsole chat runs/my-chat --base": (
        "interactive: the same chat with its input at an end at once (Ctrl-D), both models loaded",
        ["shardconsole chat runs/my-chat --base < /dev/null"]),
    "shardconsole plan --preset h200-fsdp --gpus 2 --gpu-memory 24GiB --host-memory 64GiB": (
        "does not fit, as its comment says: the same command, its exit code checked to be plan's 3",
        ["shardconsole plan --preset h200-fsdp --gpus 2 --gpu-memory 24GiB --host-memory 64GiB; test $? -eq 3"]),
    **{f"python3 benchmarks/plan_calibrate.py --subset {subset} --out $OUT/plan_{out}.json": (
        "the GPU machine's calibration (minutes of real runs): from the repository root, its matrix with the "
        "planner's predictions (--dry-run)",
        [f"cd {REPO} && python3 benchmarks/plan_calibrate.py --subset {subset} --dry-run"])
       for subset, out in (("fsdp", "fsdp"), ("deepspeed", "ds"), ("edge", "edge"))},
    "shardconsole --preset 3090-7b-offload --set precision.fp8=tensorwise --headless": (
        "needs a GPU with FP8 tensor cores: here it is refused before launch in one line, exit 2",
        ["shardconsole --preset 3090-7b-offload --set precision.fp8=tensorwise --headless; test $? -eq 2"]),
    "shardconsole --preset 4090x2-zero3 --set parallel.nnodes=4 --slurm > job.sbatch && sbatch job.sbatch": (
        "needs a Slurm cluster: the script is written as written and checked by bash's parser",
        ["shardconsole --preset 4090x2-zero3 --set parallel.nnodes=4 --slurm > job.sbatch && bash -n job.sbatch"]),
}


def readme_examples(text: str) -> list[tuple[str, str]]:
    """(section, command) for every line of README's indented code blocks: continuation lines joined,
    a trailing `  # comment` cut."""
    out: list[tuple[str, str]] = []
    section, prev_blank, in_fence = "", True, False
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_fence = not in_fence
        if line.startswith("## ") and not in_fence:
            section = line[3:].strip()
        if line.startswith("    ") and prev_blank and not in_fence:
            while i < len(lines) and lines[i].startswith("    "):
                cmd = lines[i][4:]
                while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    cmd = cmd.rstrip()[:-1].rstrip() + " " + lines[i].strip()
                cmd = re.split(r"\s{2,}#\s", cmd, maxsplit=1)[0].strip()
                if cmd:
                    out.append((section, cmd))
                i += 1
            prev_blank = False
            continue
        prev_blank = not line.strip()
        i += 1
    return out


PLACEHOLDER = re.compile(r"runs/<id>|<id>|<run folder>")


def fill(cmd: str, runs: list[Path]) -> str:
    """The placeholders a user fills: a run's folder for runs/<id>, <id> (the next run for each) and
    <run folder>; [optional] options typed; N."""
    n = iter(range(len(runs) or 1))
    cmd = PLACEHOLDER.sub(lambda m: str(runs[min(next(n, 0), len(runs) - 1)]) if runs else m.group(0), cmd)
    cmd = re.sub(r"\[([^\]]*)\]", r"\1", cmd)
    return re.sub(r"(train\.steps)=N\b", r"\1=40", cmd)


def _slug(section: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-") or "top"


def all_examples() -> list[tuple[str, str]]:
    """(folder, command) for every example of README.md, then docs/*.md in name order. The folder names
    the page and section whose examples share it (a user's working folder for that part)."""
    out = []
    for page in PAGES:
        for section, cmd in readme_examples(page.read_text()):
            where = CONTINUES.get(page.name, (page.name, section))
            out.append((_slug(" ".join(where).replace(".md", "")), cmd))
    return out


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    """Runs every example of README and docs/ in order; returns [(folder, example, command run, result)]."""
    base = tmp_path_factory.mktemp("readme")
    env = {**os.environ,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "SHARDCONSOLE_PRESETS_DIR": str(base / "user-presets"),
           "SHARDCONSOLE_CACHE_DIR": str(base / "token-cache"),
           "SHARDCONSOLE_RUNS_ROOT": str(base / "runs-root"),
           "DS_ACCELERATOR": "cpu", "COLUMNS": "120"}
    examples = all_examples()
    # What the fine-tune examples name: a model folder and a .jsonl of chats, made as a user has them.
    for folder in {f for f, cmd in examples if "path/to/model" in cmd or "chats.jsonl" in cmd}:
        make_hf_model(base / folder / "path" / "to" / "model", chat_template=True)
        with open(base / folder / "chats.jsonl", "w") as fh:
            for i in range(40):
                fh.write(json.dumps({"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                                                  {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]})
                         + "\n")
    # ... and preference pairs, the chosen answer right, the rejected one wrong.
    for folder in {f for f, cmd in examples if "pairs.jsonl" in cmd}:
        if not (base / folder / "path" / "to" / "model").exists():
            make_hf_model(base / folder / "path" / "to" / "model", chat_template=True)
        with open(base / folder / "pairs.jsonl", "w") as fh:
            for i in range(40):
                fh.write(json.dumps({"prompt": f"what is {i} plus {i}?", "chosen": f" {2 * i}.",
                                     "rejected": f" {2 * i + 1}."}) + "\n")
    # ... and prompts with an answer for GRPO, its reward file the one FINETUNE.md shows (its python block).
    for folder in {f for f, cmd in examples if "prompts.jsonl" in cmd}:
        if not (base / folder / "path" / "to" / "model").exists():
            make_hf_model(base / folder / "path" / "to" / "model", chat_template=True)
        with open(base / folder / "prompts.jsonl", "w") as fh:
            for i in range(16):
                fh.write(json.dumps({"prompt": [{"role": "user", "content": f"what is {i} plus {i}?"}],
                                     "answer": str(2 * i)}) + "\n")
        shown = re.search(r"```python\n# rewards.py\n(.*?)```", (REPO / "docs" / "FINETUNE.md").read_text(), re.S)
        assert shown, "docs/FINETUNE.md shows no ```python block starting # rewards.py"
        (base / folder / "rewards.py").write_text(shown.group(1))
    # ... and KTO's unpaired records (issue 66), each answer labelled right (true) or wrong (false).
    for folder in {f for f, cmd in examples if "feedback.jsonl" in cmd}:
        if not (base / folder / "path" / "to" / "model").exists():
            make_hf_model(base / folder / "path" / "to" / "model", chat_template=True)
        with open(base / folder / "feedback.jsonl", "w") as fh:
            for i in range(40):
                fh.write(json.dumps({"prompt": f"what is {i} plus {i}?", "completion": f" {2 * i + i % 2}.",
                                     "label": i % 2 == 0}) + "\n")
    done: list = []
    runs: list[Path] = []
    ran: dict[str, subprocess.CompletedProcess] = {}    # a command several pages show runs once
    timings: list[tuple[float, str]] = []      # seconds a command, kept beside the folders for a reader
    ordered = ([e for e in examples if not PLACEHOLDER.search(e[1])]
               + [e for e in examples if PLACEHOLDER.search(e[1])])
    for folder, example in ordered:
        cwd = base / folder
        cwd.mkdir(exist_ok=True)
        commands = NOT_AS_WRITTEN[example][1] if example in NOT_AS_WRITTEN else [example]
        for cmd in commands:
            if cmd in ran and not PLACEHOLDER.search(cmd):
                done.append((folder, example, cmd, ran[cmd]))
                continue
            filled = fill(cmd, runs)
            t0 = time.monotonic()
            res = subprocess.run(["bash", "-c", filled], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
            ran[cmd] = res
            done.append((folder, example, filled, res))
            timings.append((round(time.monotonic() - t0, 1), filled))
            m = re.search(r"^finished: .* run folder (\S+)$", res.stdout + res.stderr, re.M)
            if m and (cwd / m.group(1)).resolve() not in runs:
                runs.append((cwd / m.group(1)).resolve())
    (base / "timings.json").write_text(json.dumps(sorted(timings, reverse=True), indent=1))
    return done, base


def test_every_readme_example_runs_as_written_or_is_listed_with_its_reason(walkthrough):
    done, _ = walkthrough
    examples = all_examples()
    assert len(readme_examples(README.read_text())) >= 8 and len(examples) >= 40
    assert set(NOT_AS_WRITTEN) <= {e for _, e in examples}, "a listed example is no longer in README.md or docs/"
    failed = [f"{cmd!r} (README: {example!r}) exited {res.returncode}: {res.stderr.strip()[-600:]}"
              for _, example, cmd, res in done if res.returncode != 0]
    assert not failed, "\n".join(failed)
    ran = {example for _, example, _, _ in done}
    assert ran | {e for e, (_, instead) in NOT_AS_WRITTEN.items() if not instead} == {e for _, e in examples}


def _result(done, needle):
    return next(res for _, _, cmd, res in done if needle in cmd)


def test_printed_commands_name_absolute_paths(walkthrough):
    """A command printed for several nodes is started on each of them, from wherever: --run-dir absolute."""
    done, _ = walkthrough
    res = _result(done, "--set parallel.nnodes=2 --set parallel.rdzv_endpoint=node0:29400 --print-command")
    argv = res.stdout.split()
    run_dir = argv[argv.index("--run-dir") + 1]
    assert Path(run_dir).is_absolute() and (Path(run_dir) / "preset.toml").is_file()
    assert "--rdzv-endpoint=node0:29400" in argv and "--nnodes=2" in argv


def test_slurm_example_sets_the_rendezvous_from_the_jobs_first_node(walkthrough):
    done, base = walkthrough
    script = (base / _slug("CLUSTERS Start a run on several nodes") / "job.sbatch").read_text()
    assert "#SBATCH --nodes=4" in script
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert '--rdzv-endpoint="$head_node:' in script
    run_dir = re.search(r"--run-dir (\S+)", script).group(1)
    assert Path(run_dir).is_absolute() and (Path(run_dir) / "preset.toml").is_file()


def test_fine_tuned_model_loads_and_the_console_preset_is_the_plan_preset(walkthrough):
    done, base = walkthrough
    assert (base / _slug("README Fine-tune your model on your data") / "my-model" / "config.json").is_file()
    res = _result(done, "resume runs/my-chat")
    assert re.search(r"^finished: 40 steps", res.stdout + res.stderr, re.M)
    # the two runs side by side (README's `compare <id> <id>`): the fine-tune's own settings differ
    compared = next(res for _, example, _, res in done if example.startswith("shardconsole compare"))
    assert "data.eval_fraction" in compared.stdout and "my-chat" in compared.stdout
    # `shardconsole` opens tiny-cpu; `shardconsole plan` (no --preset) plans the same one.
    printed = _result(done, "shardconsole --print-command").stdout
    assert "--nproc-per-node=2" in printed
    plan = subprocess.run([sys.executable, "-m", "shardconsole", "plan"], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0 and plan.stdout.startswith("plan: tiny-cpu:"), plan.stderr


def test_the_readme_test_command_is_what_ci_runs():
    """README's test command and .ci/run do the same steps: the same torch pin, the same install, the same
    pytest with the same environment (CI adds only a pip upgrade), so "what CI runs" stays true."""
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    steps = [ln for ln in ci if ln.startswith(("python3 -m venv", ". .venv", "pip install", "export ", "pytest"))]
    assert TEST_COMMAND in [cmd for _, cmd in readme_examples(README.read_text())]
    readme_steps = TEST_COMMAND.split(" && ")
    want = [re.sub(r"^pip install -q ", "pip install ", s) for s in steps]      # CI's installs are quiet
    assert want == ["python3 -m venv .venv", ". .venv/bin/activate", "pip install torch==2.13.0",
                    "pip install -e '.[test]'", "export DS_ACCELERATOR=cpu", "pytest -q -p no:cacheprovider"], ci
    assert readme_steps[:4] == want[:4]
    assert readme_steps[4] == "DS_ACCELERATOR=cpu " + want[5]
