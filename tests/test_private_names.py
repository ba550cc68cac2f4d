"""No shardconsole module reaches into another shardconsole module's underscore-private names
(issue 65): a name used outside its module is part of that module's interface, so it is spelled
public. Third-party privates (torch._C, FSDP2's group internals, ...) are not checked here: they
are not ours to rename, and only names of shardconsole modules are looked at."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shardconsole"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_names() -> set[str]:
    out = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def private_reaches(path: Path, modules: set[str]) -> list[str]:
    """Each `from shardconsole.x import _name` and each `mod._name` where mod is a shardconsole
    module bound by an import, in one file, as 'line: what'."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "shardconsole":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                elif _is_private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "shardconsole":
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "shardconsole"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(f"{node.lineno}: {ast.unparse(node)} ({aliases[base.id]})")
    return found


def test_no_module_imports_another_modules_private_name():
    modules = _module_names()
    found = [f"{path.relative_to(PACKAGE.parent)}:{hit}"
             for path in sorted(PACKAGE.rglob("*.py")) for hit in private_reaches(path, modules)]
    assert not found, "private names used across modules; make them public:\n" + "\n".join(found)


def test_checker_sees_both_forms(tmp_path):
    """The checker itself: an import of a private name and an attribute use through a module alias
    are caught; a public name, a private alias of a public name, and torch's privates are not."""
    src = tmp_path / "probe.py"
    src.write_text("import torch\nfrom shardconsole.plan import shapes as sh\n"
                   "from shardconsole.plan.shapes import _numel, pow2_ceil as _p\n"
                   "x = sh._shard_numel\ny = torch._C\nz = sh.pow2_ceil\n")
    hits = private_reaches(src, _module_names())
    assert len(hits) == 2, hits
    assert "import _numel" in hits[0] and "sh._shard_numel" in hits[1]

