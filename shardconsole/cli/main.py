"""The command line's entry: one module of cli/ per subcommand, dispatched here. `shardconsole` opens the console; `--headless` runs the same job without a UI.

    shardconsole [--preset NAME|FILE] [--set table.key=value ...] [--headless | --print-command]
    shardconsole presets
    shardconsole attach RUN_DIR [--headless]
    shardconsole stop RUN_DIR
    shardconsole resume RUN_DIR [--set table.key=value ...]
    shardconsole export-model RUN_DIR -o OUT_DIR [--step N] [--dtype bf16|fp32]
    shardconsole settings [TABLE] [--json]      every setting: type, default, allowed values, help
    shardconsole chat RUN_DIR|MODEL_DIR         talk to a run's last checkpoint or a model folder
    shardconsole data | plan | export | import | tune | runs | compare | doctor   (each has --help)
    shardconsole --version

Bad input (a preset, an override, a model folder) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys

from shardconsole import envvars
from shardconsole.cli.attach import cmd_attach
from shardconsole.cli.commands import LAZY_SUBCOMMANDS, OPTIONAL_SUBCOMMANDS
from shardconsole.cli.errors import UsageError
from shardconsole.cli.presets import cmd_presets
from shardconsole.cli.run import cmd_run
from shardconsole.cli.stop import cmd_stop
from shardconsole.settings import config as C
from shardconsole.settings.models import ModelError


# The rest of the names, and the --help list, are in cli/commands.py (run.py lists them; main imports run).
SUBCOMMANDS = {"presets": cmd_presets, "attach": cmd_attach, "stop": cmd_stop}     # commands.EAGER


def _lazy(target: str):
    def command(argv: list[str]) -> int:
        import importlib
        module, func = target.split(":")
        return getattr(importlib.import_module(module), func)(argv)
    return command


def _register_optional() -> None:
    """Subcommands that live in their own modules (kept out of start-up when unused)."""
    import importlib
    for name, target in LAZY_SUBCOMMANDS.items():
        SUBCOMMANDS.setdefault(name, _lazy(target))
    for name, target in OPTIONAL_SUBCOMMANDS.items():
        module, func = target.split(":")
        try:
            SUBCOMMANDS.setdefault(name, getattr(importlib.import_module(module), func))
        except ImportError:
            pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from shardconsole.session.signals import Detach, front_end_signals, quiet_stdout
    try:
        with front_end_signals():
            return _dispatch(argv)
    except BrokenPipeError:     # output into a closed pipe (`| head -1`): quiet, as a Unix tool is
        quiet_stdout()
        return 141
    except Detach:
        # attach before it follows: the run goes on without it, as after any detach (EXIT_CODES "detached")
        return 8 if argv[:1] == ["attach"] else 129


def _dispatch(argv: list[str]) -> int:
    import logging
    # peft's import pulls torchao where it is installed, which logs kernels a CPU build lacks ("Failed to
    # load ..._C_mxfp8.so") on every command that loads transformers: nothing for the user to act on, and
    # a refusal must stay one line.
    for name in ("torchao", "torch.utils._pytree"):     # and torchao's pytree deprecations
        logging.getLogger(name).setLevel(logging.ERROR)
    from shardconsole import __version__
    from shardconsole.machine.torch_version import torch_problem, version_line
    if argv[:1] == ["-V"] or (argv[:1] and argv[0].startswith("-") and "--version" in argv):
        print(version_line(__version__))
        problem = torch_problem()
        if problem:
            print(f"shardconsole: {problem}", file=sys.stderr)
        return 0
    problem = torch_problem()
    if problem and argv[:1] not in (["-h"], ["--help"]):
        print(f"shardconsole: error: {problem}", file=sys.stderr)
        return 2
    try:
        if argv[:1] not in (["-h"], ["--help"]):
            # every variable a user may set, checked before anything reads it: the ranks and torchrun then
            # never meet a bad one (a traceback in torchrun, a ValueError in a rank, a silent default)
            envvars.check()
        if argv and not argv[0].startswith("-"):
            _register_optional()
            if argv[0] not in SUBCOMMANDS:
                raise UsageError(f"unknown command {argv[0]!r}; commands: {', '.join(sorted(SUBCOMMANDS))}, "
                                 f"or options such as --preset NAME --headless")
            return SUBCOMMANDS[argv[0]](argv[1:])
        return cmd_run(argv)
    except (C.ConfigError, ModelError, UsageError, envvars.EnvError) as e:
        print(f"shardconsole: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        from shardconsole.settings.paths import error_line, is_path_error
        if not is_path_error(e):
            raise
        # A path given on the command line that cannot be looked at (too long, a part not a folder, no
        # permission) is bad input like any other: one line, exit 2, wherever it was first touched.
        print(f"shardconsole: error: {error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
