"""GRPO's reward functions ([grpo] reward: FILE.py:FUNCTION, ...), loaded on each rank and called as TRL's
GRPOTrainer calls them: f(prompts=, completions=, completion_ids=, **columns), one value a completion,
prompts and columns repeated for each of a prompt's completions; conversational prompts get completions as
[{"role": "assistant", "content": text}]. A raise, a wrong count or a value that is not a finite number
stops the run with RewardError naming the function and the record (file:line)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Callable

import torch

from shardconsole.backends.rank.errors import RewardError


def load(specs: list[tuple[str, str]]) -> list[tuple[str, Callable[..., Any]]]:
    """[(name "FILE.py:FUNCTION", function)]; the files were checked before launch (settings/grpo_rules.py)."""
    out = []
    for k, (path, fn) in enumerate(specs):
        name = f"{path}:{fn}"
        file = Path(path).expanduser()
        spec = importlib.util.spec_from_file_location(f"shardconsole_reward_{k}", file)
        if spec is None or spec.loader is None:
            raise RewardError(f"[grpo] reward: {name}: {file} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise RewardError(f"[grpo] reward: {name}: importing {file} raised {type(e).__name__}: {e}") from None
        f = getattr(module, fn, None)
        if not callable(f):
            raise RewardError(f"[grpo] reward: {name}: {file} has no callable {fn!r}")
        out.append((name, f))
    return out


def score(funcs: list[tuple[str, Callable[..., Any]]], prompts: list[Any], completions: list[Any],
          completion_ids: list[list[int]], columns: dict[str, list[Any]], where: list[str]) -> torch.Tensor:
    """[N, functions] float64 on the host; `where` names each completion's record."""
    n = len(completions)
    out = torch.zeros((n, len(funcs)), dtype=torch.float64)
    for j, (name, f) in enumerate(funcs):
        try:
            values = f(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:
            raise RewardError(f"[grpo] reward {name} raised {type(e).__name__}: {str(e)[:200]} (on the completions "
                              f"of {where[0]}{' ...' if len(set(where)) > 1 else ''})") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(f"[grpo] reward {name} returned {type(values).__name__}, not a list of {n} numbers "
                              f"(on the completions of {where[0]})") from None
        if len(values) != n:
            raise RewardError(f"[grpo] reward {name} returned {len(values)} values for {n} completions "
                              f"(on the completions of {where[0]})")
        for i, v in enumerate(values):
            try:
                x = float(v)
            except (TypeError, ValueError):
                x = math.nan
            if not math.isfinite(x):
                raise RewardError(f"[grpo] reward {name} returned {v!r} (not a finite number) for a completion "
                                  f"of {where[i]}")
            out[i, j] = x
    return out
