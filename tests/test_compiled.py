"""train.compile under activation checkpointing: the decoder layers really compile, and a run says so.

With transformers' `kernels` wrapper around each attention (transformers >= 5.2x), torch's default refused
the wrapper's global set/reset inside a checkpoint and ran every checkpointed layer eager, silently: the
compiled presets (3090-7b-offload, 3090-3b-adamw8bit, ...) trained at eager's speed. These tests trace the
project's own layers through dynamo (the "eager" backend: the tracing is what falls back, not the kernels)
and read dynamo's own counters, the ones the rank's line after its first step reads.
"""

from __future__ import annotations

import pytest
import torch

from shardconsole.settings import resolve as settings
from shardconsole.backends.model import modeling
from shardconsole.backends.observe import compiled
from shardconsole.settings.models import resolve


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def _train_step(policy: str) -> None:
    """One forward + backward of tiny-cpu's model as an FSDP2 rank builds it: checkpointed, each decoder
    layer compiled."""
    cfg = settings.resolve("tiny-cpu", []).cfg
    hf_cfg = modeling.hf_config(resolve(cfg.model.name), cfg)
    model = modeling.CausalLMLoss(modeling.build_causal_lm(hf_cfg))
    modeling.apply_checkpointing(model.lm, policy, compiled=True)
    for layer in modeling.decoder_layers(model.lm):
        layer.compile(backend="eager")
    ids = torch.randint(0, hf_cfg.vocab_size, (2, 32))
    model(ids, ids).backward()


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_layers_compile_whole(fresh_dynamo, policy):
    _train_step(policy)
    graphs, breaks = compiled.counts()
    assert breaks == {}, list(breaks)[:1]
    assert graphs >= 1
    kind, line = compiled.verdict(graphs, breaks)
    assert kind == "log" and line == f"compile: {graphs} graphs compiled, no graph break"


def test_a_graph_break_is_a_warning_naming_the_reason(fresh_dynamo):
    def body(x):
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1

    torch.compile(body, backend="eager")(torch.ones(3))
    graphs, breaks = compiled.counts()
    assert graphs == 2 and sum(breaks.values()) == 1
    kind, line = compiled.verdict(graphs, breaks)
    assert kind == "warning"
    assert line.startswith("train.compile: 1 graph breaks in the first step (2 graphs compiled)")
    assert "graph_break" in line.lower() and "\n" not in line


def test_nothing_compiled_is_a_warning(fresh_dynamo):
    kind, line = compiled.verdict(*compiled.counts())
    assert kind == "warning" and "nothing compiled in the first step" in line
