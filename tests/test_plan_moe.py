"""Mixture-of-experts configs in the planner (issue 31 item 10): their experts, router and shared expert
counted exactly (against transformers' own model, built on the meta device), or the config refused as
unknown; never counted as a dense model (a 32-expert Mixtral planned at 17.0M parameters used 9.7 GiB).
And the tokenizing memory bounded: a long record is tokenized in pieces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardconsole.plan.shapes import Shapes
from shardconsole.settings.models import ModelError, resolve

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=256)
CONFIGS = {
    "mixtral": dict(num_local_experts=32, num_experts_per_tok=2, intermediate_size=96),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=128,
                      shared_expert_intermediate_size=80),
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, intermediate_size=128,
                      head_dim=16),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=40),
}


def folder_of(tmp_path: Path, model_type: str, **extra) -> Path:
    """A model folder of transformers' own config for this type (every key its config class writes)."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(model_type, **SMALL, **extra)
    folder = tmp_path / model_type
    cfg.save_pretrained(folder)
    return folder


def real_count(folder: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_experts_are_counted_as_transformers_builds_them(tmp_path, model_type):
    folder = folder_of(tmp_path, model_type, **CONFIGS[model_type])
    spec = resolve(str(folder))
    want = real_count(folder)
    assert Shapes.of(spec).n_params == want and spec.n_params == want


def test_a_mixture_of_experts_it_cannot_count_is_refused(tmp_path):
    folder = tmp_path / "phimoe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "phimoe", "num_local_experts": 16,
                                                    "num_experts_per_tok": 2, "intermediate_size": 64, **SMALL}))
    with pytest.raises(ModelError, match=r"mixture-of-experts model \(phimoe\).*cannot count"):
        resolve(str(folder))
    mixed = folder_of(tmp_path, "qwen2_moe", **{**CONFIGS["qwen2_moe"], "mlp_only_layers": [0]})
    with pytest.raises(ModelError, match="dense and sparse layers mixed"):
        resolve(str(mixed))


def test_a_long_record_is_tokenized_in_pieces_with_the_same_ids(tmp_path):
    """One record of 2 MB: no tokenizer call gets more than CHUNK_CHARS of it (a 50 MB record took a
    rank to 9.9 GiB in one call), and the ids equal the whole text's."""
    from hf_fixtures import train_tokenizer
    from shardconsole.backends.data import corpus
    tok = train_tokenizer(384)
    words = "the quick brown fox jumps over the lazy dog, sharded training keeps parameters split".split()
    text = "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(i % 23 + 1)) + "  end."
                     for i in range(25_000))
    assert len(text) > 20 * corpus.CHUNK_CHARS
    longest = []

    class Recording:        # the real tokenizer, and the length of the longest text it was handed
        def __call__(self, texts, **kw):
            longest.append(max(len(t) for t in texts))
            return tok(texts, **kw)
    enc = corpus.Encoder(Recording(), tok.eos_token_id, "bpe")
    [ids] = enc.encode([text])
    assert max(longest) <= 2 * corpus.CHUNK_CHARS and len(longest) > 10
    assert ids == tok([text], add_special_tokens=False)["input_ids"][0]


def test_the_plan_counts_the_tokenizers_bounded_work(tmp_path):
    """A run on records plans the tokenizing moment: the ranks' base, and the one building rank's
    tokenizer work, bounded by the text it is handed at once (not by the records' length)."""
    from shardconsole import plan
    from shardconsole.settings import preset_store
    from shardconsole.settings.data.data_scan import TOKENIZE_WORK_BYTES
    cfg = preset_store.load("tiny-cpu")
    spec = resolve(cfg.model.name)
    hw = plan.detect_hardware()
    synthetic = plan.estimate(cfg, spec, hw)
    cfg.data.path = str(tmp_path / "records.jsonl")
    records = plan.estimate(cfg, spec, hw)
    [part] = [v for k, v in records.host_parts.items() if k.startswith("tokenizer before training")]
    assert part == TOKENIZE_WORK_BYTES and records.host_peak_bytes > synthetic.host_peak_bytes
