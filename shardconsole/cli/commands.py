"""The subcommands cli/main.py dispatches, by name: in a module of their own so that the run parser
(cli/run.py, which main imports) lists them in `shardconsole --help` without importing main."""

from __future__ import annotations

# Imported by main at start-up (small modules the console needs anyway).
EAGER = ("presets", "attach", "stop")

# Subcommands in their own modules, imported only when named ("module:function"): start-up stays
# as light as the console needs, and each command's module owns its parser.
LAZY_SUBCOMMANDS = {
    "settings": "shardconsole.cli.settings:cmd_settings",
    "data": "shardconsole.cli.data:cmd_data",
    "resume": "shardconsole.cli.resume:cmd_resume",
    "export-model": "shardconsole.cli.trained_model.export_model:cmd_export_model",
    "chat": "shardconsole.cli.trained_model.chat:cmd_chat",
    "tune": "shardconsole.cli.tune:cmd_tune",
    "runs": "shardconsole.cli.runs:cmd_runs",
    "compare": "shardconsole.cli.runs:cmd_compare",
    "doctor": "shardconsole.cli.doctor:cmd_doctor",
}
# ... and those whose module may not import (an optional dependency): left out of the dispatcher then.
OPTIONAL_SUBCOMMANDS = {
    "export": "shardconsole.cli.ds_json:cmd_export",
    "import": "shardconsole.cli.ds_json:cmd_import",
    "plan": "shardconsole.cli.plan:cmd_plan",
}


def command_names() -> list[str]:
    """Every subcommand the dispatcher knows, for `shardconsole --help` (cli/run.py): one list, so the help
    cannot leave one out."""
    return [*EAGER, *LAZY_SUBCOMMANDS, *OPTIONAL_SUBCOMMANDS]
