"""Every subcommand the dispatcher names by "module:function" (cli/commands.py) resolves: the names are
strings, imported only when the command is given, so a module moved to another room (cli/trained_model/)
with its string left behind would fail only when a user types that command, and no import checker sees it."""

from __future__ import annotations

import importlib

import pytest

from shardconsole.cli.commands import LAZY_SUBCOMMANDS, OPTIONAL_SUBCOMMANDS


@pytest.mark.parametrize("name", sorted({**LAZY_SUBCOMMANDS, **OPTIONAL_SUBCOMMANDS}))
def test_every_named_subcommand_imports_and_is_a_function(name):
    module, func = {**LAZY_SUBCOMMANDS, **OPTIONAL_SUBCOMMANDS}[name].split(":")
    assert callable(getattr(importlib.import_module(module), func)), name
