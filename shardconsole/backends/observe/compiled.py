"""train.compile checked after the first step: did the layers compile, or did torch fall back to eager?

torch.compile never fails loudly when it cannot trace: a graph break splits the graph, and a break inside
an activation checkpoint (a higher-order op) sends the whole layer back to eager. The run then trains at
eager's speed and memory while the settings say compiled (transformers' `kernels` wrapper did exactly
that to every checkpointed layer: modeling.apply_checkpointing). dynamo counts what it did; after the
first step this reads the count and says it in one line, a warning when a graph broke or none compiled.
"""

from __future__ import annotations

from shardconsole.backends.rank.common import Rank


def counts() -> tuple[int, dict[str, int]]:
    """(graphs compiled so far, {graph-break reason: times}) in this process."""
    from torch._dynamo.utils import counters
    return int(counters["stats"].get("unique_graphs", 0)), dict(counters["graph_break"])


def verdict(graphs: int, breaks: dict[str, int]) -> tuple[str, str]:
    """("log" | "warning", the line) for what dynamo counted."""
    if not breaks and graphs:
        return "log", f"compile: {graphs} graphs compiled, no graph break"
    if not breaks:
        return "warning", ("train.compile: nothing compiled in the first step (the layers ran eager); "
                           "set train.compile = false to say so, or report it")
    reason = max(breaks, key=breaks.__getitem__)
    first = reason.strip().splitlines()[0][:160]
    return "warning", (f"train.compile: {sum(breaks.values())} graph breaks in the first step ({graphs} graphs "
                       f"compiled), the code after each break runs eager (slower, more memory); the most "
                       f"frequent: {first}")


def check(r: Rank) -> None:
    """After the first step of a compiled run: its one line (rank 0's as an event if it warns)."""
    kind, line = verdict(*counts())
    r.log(line)
    if kind == "warning":
        r.event("warning", line)
