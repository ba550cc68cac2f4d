"""train.objective = "grpo" and [grpo], checked before launch (config.validate): the reward functions exist
with TRL's signature, the values fit together. The reward files are read, never run: their functions are
found in the file's syntax tree, so a check costs no import of the user's code (nor its side effects)."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from shardconsole.settings.values import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from shardconsole.settings.tables import RunConfig

SIGNATURE = "f(prompts, completions, **kwargs) -> list[float]"


def check(cfg: RunConfig, err: Callable[[str, str, str], ConfigError]) -> None:
    t, g = cfg.train, getattr(cfg, "grpo", None)
    if g is None or getattr(t, "objective", "sft") != "grpo":
        return
    d = cfg.data
    if d.source in ("synthetic", "tokens") or not d.path:
        raise err("train", "objective", "\"grpo\" samples completions of prompts: set data.path to records with a "
                  "'prompt' (a string or a message list); synthetic tokens and token files have none")
    specs = g.reward_specs()
    if not specs:
        raise err("grpo", "reward", f"is empty: name at least one reward function, FILE.py:FUNCTION ({SIGNATURE})")
    for path, fn in specs:
        reward_problem = problem(path, fn)
        if reward_problem:
            raise err("grpo", "reward", reward_problem)
    try:
        weights = g.weights()
    except ValueError:
        raise err("grpo", "reward_weights", f"{g.reward_weights!r}: comma-separated numbers, one per reward "
                  "function") from None
    if len(weights) != len(specs) or not all(math.isfinite(w) for w in weights):
        raise err("grpo", "reward_weights", f"has {len(weights)} finite weight(s) for {len(specs)} reward "
                  "function(s): give one finite number per function, or leave it empty (1 each)")
    if d.seq_len <= g.max_new_tokens:
        raise err("grpo", "max_new_tokens", f"is {g.max_new_tokens}, not below data.seq_len ({d.seq_len}), which "
                  "holds the prompt and its completion: raise data.seq_len or lower max_new_tokens")
    if g.beta and not cfg.adapters:
        offloaded = (("fsdp", "cpu_offload") if cfg.parallel.backend == "fsdp" and cfg.fsdp.cpu_offload else
                     ("deepspeed", "offload_param") if cfg.parallel.backend == "deepspeed"
                     and cfg.deepspeed.offload_param != "none" else None)
        if offloaded:
            raise err("grpo", "beta", f"is {g.beta} with {offloaded[0]}.{offloaded[1]} on: full fine-tuning's KL "
                      "keeps a frozen copy of the model beside it, which is not built for offloaded parameters yet; "
                      "set grpo.beta = 0, turn the offload off, or train.method = \"lora\"")
    if cfg.data.eval_path or cfg.data.eval_fraction:
        raise err("data", "eval_path" if cfg.data.eval_path else "eval_fraction",
                  "GRPO has no held-out evaluation yet (the step lines carry the rewards): remove it")


def problem(path: str, fn: str) -> str:
    """What is wrong with one FILE.py:FUNCTION, in one line; "" when nothing."""
    item = f"{path}:{fn}"
    if not path or not fn or not path.endswith(".py"):
        return f"{item!r}: expected FILE.py:FUNCTION, e.g. rewards.py:correct ({SIGNATURE})"
    file = Path(path).expanduser()
    if not file.is_file():
        return f"{item!r}: no file {file}"
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except (OSError, UnicodeDecodeError, SyntaxError) as e:
        return f"{item!r}: {file} does not parse as Python: {type(e).__name__}: {str(e)[:120]}"
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == fn:
            return _signature_problem(item, node)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == fn for t in node.targets):
            return ""        # fn = functools.partial(...), a callable object: its call is checked on the ranks
    return f"{item!r}: {file} defines no function {fn!r} at its top level"


def _signature_problem(item: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """TRL calls a reward function with keywords: prompts=, completions=, completion_ids= and each column."""
    if isinstance(node, ast.AsyncFunctionDef):
        return f"{item!r}: is async; a reward function is a plain function {SIGNATURE}"
    a = node.args
    if a.kwarg is None:
        return (f"{item!r}: takes no **kwargs; a reward function is {SIGNATURE} (it is called with "
                "prompts=, completions=, completion_ids= and each data column as keywords)")
    if a.posonlyargs:
        return f"{item!r}: has positional-only parameters; it is called with keywords ({SIGNATURE})"
    return ""
