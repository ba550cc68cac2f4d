"""What the setup screen says of its settings in words: the pick lists' entries, the model's line, the
help line of a field, and the summary under the form (problems, changes, command, estimate, machine).

Pure functions of the settings and what was found; setup.py places them (it shows and edits, these
words are made here, setup_actions.py acts on the result).
"""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.widgets.option_list import Option

from shardconsole.launch.job import format_argv
from shardconsole.settings import config as C
from shardconsole.settings import preset_store
from shardconsole.settings.models import CATALOG, ModelError, human_count, resolve

from shardconsole.console import fields as F
from shardconsole.console.card_plan import speed_text
from shardconsole.console.services import Machine, PlannedRun, Planner, describe_estimate, describe_machine

KINDS = {"select": "choose with enter", "switch": "space toggles", "number": "a number",
         "size": "a size such as 24GiB or 512MiB", "text": "text"}


def model_options() -> list[Option]:
    out = []
    width = max(len(name) for name in CATALOG)      # "mistral-small-24b": the counts in one column
    for name in CATALOG:
        spec = resolve(name)
        out.append(Option(Text.assemble((f"{name:<{width}}", "bold"), f" {human_count(spec.n_params):>6}"), id=name))
    return out


def preset_options() -> list[Option]:
    out = []
    for info in preset_store.list_presets():
        prompt = Text.assemble((info.name, "bold"), "  ", (info.origin, "dim"))
        if info.description:
            prompt.append("\n" + info.description, "italic")
        out.append(Option(prompt, id=info.name))
    return out


def model_info(name: str, error: str = "") -> Text:
    """The model's line under the pickers: its size and shape, or why it cannot be used."""
    if error:
        return Text(error, "red")
    try:
        spec = resolve(name)
    except ModelError as e:
        return Text(str(e), "red")
    text = Text.assemble((spec.name if spec.path is None else Path(spec.name).name, "bold"),
                         f": {human_count(spec.n_params)} params · {spec.layers} layers · hidden {spec.hidden}")
    if spec.path is not None:
        text.append("; weights found" if spec.has_weights else "; no weights: trains from random init")
    return text


def field_help(spec: F.FieldSpec) -> Text:
    """The help line of the focused field: its key, what it means, how to fill it."""
    return Text.assemble((spec.path, "bold"), f" — {spec.help}  ", (f"({KINDS[spec.kind]}"
                         + (", empty for the default" if spec.optional and spec.kind != "select" else "")
                         + ")", "dim"))


def problems_text(problems: list[tuple[str, str]], cfg: C.RunConfig, machine: Machine) -> Text:
    """The first problem (and how many more), or the warning that a GPU preset trains on the CPU here."""
    bad = Text(no_wrap=False)
    if problems:
        path, detail = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        bad.append(f"✗ {path}: {detail}{more}", "bold red")
    elif machine.detected and not machine.gpus and cfg.parallel.device == "auto":
        # Valid, but easy to miss: a GPU preset on a machine without one trains on the CPU.
        bad.append("! no GPU here: parallel.device = auto runs the ranks on the CPU (slow beyond tiny)", "yellow")
    return bad


def changes_text(preset_name: str, changes: list[str], notes: list[str]) -> Text:
    line = Text()
    line.append("Changes ", "bold")
    if changes:
        line.append(f"from {preset_name}: " + " · ".join(changes))
    else:
        line.append(f"from {preset_name}: none", "dim")
    if notes:   # what the CLI says of these settings (deepspeed keys from the fsdp table, fp16
        line.append(" · " + "; ".join(notes), "dim")          # keys a dtype change dropped)
    return line


def command_text(planned: PlannedRun) -> Text:
    cmd = Text()
    cmd.append("Command ", "bold")
    cmd.append(format_argv(planned.argv))
    return cmd


def estimate_text(plan: Planner | None, cfg: C.RunConfig, machine: Machine, planned: PlannedRun,
                  valid: bool) -> Text:
    estimate, fits = (describe_estimate(plan, cfg, machine, planned.run_dir) if valid else
                      ("Memory estimate: once the settings are valid", None))
    text = Text(estimate, "red" if fits is False else "dim" if plan is None else "")
    speed = speed_text(cfg, machine.plan_hardware) if valid and fits and plan is not None else ""
    if speed:    # the time to train.steps, as `shardconsole plan` gives it (a card chosen, or this machine's)
        text.append("\n" + speed)
    return text


def machine_text(machine: Machine) -> Text:
    return Text(describe_machine(machine), "dim")
