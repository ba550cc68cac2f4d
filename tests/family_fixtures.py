"""Toy Hugging Face folders of the model families people fine-tune today, made in the test from
transformers' own config classes: 2 layers, hidden 64, grouped-query attention, and each family's own
quirks kept (qk-norm, tied embeddings, a head_dim that is not hidden / heads, fused qkv and gate_up,
sliding-window layers, Gemma's scaled embeddings and (1 + w) norms, experts).

    folder = make_family_model(tmp_path / "gemma3", "gemma3")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.hf_fixtures import tokenizer_folder

_SHARED = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, max_position_embeddings=1024)

# family -> (config class name, its extra keys): the shapes of the real 2025-26 releases, shrunk
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.2 1B/3B tie the head to the embedding; rope theta 500k
    "llama3": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)),
    # qk-norm (RMSNorm over head_dim), head_dim 32 != 64 / 4
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-6)),
    # Qwen2.5: biases on q, k and v (not o), tied at small sizes
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rms_norm_eps=1e-6)),
    # sliding-window attention configured
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=16, tie_word_embeddings=False)),
    # scaled embeddings, (1 + w) norms, 4 norms a layer + qk-norm, local/global layers, tied
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                        layer_types=["sliding_attention", "full_attention"],
                                        tie_word_embeddings=True)),
    # fused qkv_proj and gate_up_proj
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, sliding_window=None, pad_token_id=None)),
    # experts: every layer sparse, qk-norm
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)),
}


def family_config(family: str, vocab_size: int, **overrides: Any):
    import transformers
    cls_name, extra = FAMILIES[family]
    kwargs = {**_SHARED, **extra, "vocab_size": vocab_size, **overrides}
    config = getattr(transformers, cls_name)(**kwargs)
    return config


def make_family_model(folder: Path, family: str, *, seed: int = 0, chat_template: bool = True,
                      vocab_size: int = 384, weights: bool = True) -> Path:
    """A model folder of `family` (config.json, generation_config.json, model.safetensors unless
    `weights` is false, tokenizer files with a chat template) that models.resolve and transformers'
    Auto classes accept."""
    import torch
    from transformers import AutoModelForCausalLM
    folder = Path(folder)
    tok = tokenizer_folder(folder, vocab_size, chat_template)
    ids = dict(eos_token_id=tok.eos_token_id, bos_token_id=None)
    if FAMILIES[family][1].get("pad_token_id", 0) is not None:
        ids["pad_token_id"] = tok.pad_token_id
    config = family_config(family, len(tok), **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    if weights:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        config.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
    return folder
