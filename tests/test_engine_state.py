"""An engine's state is declared in its class (what build and ready set, with its type), not grown by the
methods that first assign it: a reader sees everything an engine holds in one place, and mypy checks each
assignment against the declaration."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[1] / "shardconsole" / "backends" / "engine"


def undeclared(path: Path, name: str) -> list[str]:
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)
    declared = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    init = next(fn for fn in methods if fn.name == "__init__")
    declared |= set(assigned(init))       # set in __init__: declared there
    return [f"{m.name}: self.{a}" for m in methods for a in assigned(m) if a not in declared]


def assigned(fn: ast.FunctionDef) -> list[str]:
    """The attributes of self that `fn` assigns (self.x = ..., self.x, y = ..., self.x: T = ...)."""
    out = []
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) else []
        for t in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.append(t.attr)
    return out


@pytest.mark.parametrize("module, name", [("fsdp_engine.py", "FsdpEngine"), ("ds_engine.py", "DeepSpeedEngine")])
def test_every_attribute_an_engine_sets_is_declared(module, name):
    assert undeclared(ENGINE / module, name) == []


def test_the_fsdp_step_asks_one_update():
    """FsdpEngine.step reads top-down: its three update paths (plain, step in the backward, the host step
    overlapped) are fsdp_update's, chosen once at ready(), not branches of the step."""
    import inspect
    from shardconsole.backends.engine.fsdp_engine import FsdpEngine
    body = inspect.getsource(FsdpEngine.step)
    assert "self.update.arm(step)" in body and "self.update.apply()" in body
    assert not [w for w in ("in_backward", "overlap.", "clip(", "unscale(", "scaling.step(") if w in body]
