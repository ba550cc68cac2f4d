"""Real Hugging Face model folders made in a test: a tiny Llama config, random weights saved with
save_pretrained, and a byte-level BPE tokenizer trained by `tokenizers` in well under a second.

    folder = make_hf_model(tmp_path / "model")                 # a base model: no chat template
    folder = make_hf_model(tmp_path / "chat", chat_template=True)
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Sharded training keeps parameters, gradients and optimizer states split across ranks.",
    "A checkpoint holds the model, the optimizer and the data position.",
    "User: what is two plus two? Assistant: two plus two is four.",
    "Question: name a colour. Answer: blue.",
    "Offload moves the optimizer step to the host, where memory is larger and slower.",
] * 20

# A ChatML-like template, as many instruct models ship it.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE fast tokenizer (transformers' PreTrainedTokenizerFast) with an EOS and a pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   bos_token=None, unk_token=None)


def tokenizer_folder(folder: Path, vocab_size: int = 384, chat_template: bool = False):
    """`folder` made, with train_tokenizer's tokenizer saved in it (and CHAT_TEMPLATE); the tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


def make_hf_model(folder: Path, *, chat_template: bool = False, vocab_size: int = 384, seed: int = 0,
                  tie_word_embeddings: bool = False, dtype: str = "float32", positions: int = 1024) -> Path:
    """A Llama-architecture model folder (config.json, generation_config.json, model.safetensors,
    tokenizer files) that models.resolve and transformers' Auto classes both accept. `dtype`: the
    weights' dtype in the file (torch's name: "float32", "bfloat16"); `positions`: max_position_embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = Path(folder)
    tok = tokenizer_folder(folder, vocab_size, chat_template)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=176, vocab_size=len(tok), max_position_embeddings=positions,
                         tie_word_embeddings=tie_word_embeddings, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def policy_and_reference(tok):
    """A tiny fp32 Llama for tok (seed 0) and a reference nudged off it (0.05 x noise on every weight): the
    pair the TRL oracle tests (preference, GRPO) compute both implementations' losses on."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=176, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(cfg).float()
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, ref
