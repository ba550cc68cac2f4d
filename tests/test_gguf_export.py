"""GGUF export (issue 66): `export-model --gguf` from each family's Hugging Face folder and from a run, and
train.export_gguf at the end of a LoRA run, read back with llama.cpp's own reader (gguf.GGUFReader) and
dequantizer (gguf.quants.dequantize).

The expected side never comes from the code under test: the tensor names are llama.cpp's, written out
here per family; the values are transformers' (the folder's model) or the export's safetensors, put in
llama.cpp's layout by this file's own index arithmetic (q/k rows of each head interleaved, Gemma's
norms + 1); the tokens are the tokenizer's own id order.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.conftest import shardconsole
from tests.family_fixtures import make_family_model

FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]
ARCH = {"llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
        "phi3": "phi3"}

# llama.cpp's tensor names (its gguf-py tensor_mapping / llama-arch.cpp) -> the Hugging Face names, per layer.
_ATTN = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
         "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
         "attn_output.weight": "self_attn.o_proj.weight"}
_MLP = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight"}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
LAYER = {
    "llama3": {**_ATTN, **_MLP, "ffn_norm.weight": "post_attention_layernorm.weight"},
    "mistral": {**_ATTN, **_MLP, "ffn_norm.weight": "post_attention_layernorm.weight"},
    "qwen2": {**_ATTN, **_MLP, "ffn_norm.weight": "post_attention_layernorm.weight",
              "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
              "attn_v.bias": "self_attn.v_proj.bias"},
    "qwen3": {**_ATTN, **_MLP, **_QK_NORM, "ffn_norm.weight": "post_attention_layernorm.weight"},
    "gemma3": {**_ATTN, **_MLP, **_QK_NORM, "post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "phi3": {"attn_norm.weight": "input_layernorm.weight", "attn_qkv.weight": "self_attn.qkv_proj.weight",
             "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"},
}
TIED = {"llama3", "qwen2", "gemma3"}      # tied in tests/family_fixtures.py: no output.weight, llama.cpp uses token_embd


def expected_names(family: str, tied: bool, layers: int = 2) -> dict[str, str]:
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not tied:
        names["output.weight"] = "lm_head.weight"
    for i in range(layers):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in LAYER[family].items()})
    return names


def interleave_heads(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order from Hugging Face's: in each head, HF keeps the rotary pairs' first
    halves, then their second halves; llama.cpp keeps each pair side by side."""
    hd = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(hd // 2):
            out[h * hd + 2 * i] = w[h * hd + i]
            out[h * hd + 2 * i + 1] = w[h * hd + i + hd // 2]
    return out


def llama_cpp_layout(family: str, hf_name: str, w: np.ndarray, config: dict) -> np.ndarray:
    if ARCH[family] == "llama" and hf_name.endswith("q_proj.weight"):
        return interleave_heads(w, config["num_attention_heads"])
    if ARCH[family] == "llama" and hf_name.endswith("k_proj.weight"):
        return interleave_heads(w, config["num_key_value_heads"])
    if family == "gemma3" and hf_name.endswith("norm.weight"):
        return w + 1.0           # Gemma's RMSNorm scales by (1 + w)
    return w


def read_back(t) -> np.ndarray:
    """A GGUF tensor as float32 in numpy order, through gguf's own reader and dequantizer."""
    if t.tensor_type.name in ("F32", "F16"):
        return np.asarray(t.data, dtype=np.float32)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


def rounded(x: np.ndarray, kind: str) -> np.ndarray:
    """x as the GGUF type stores it, rounded by numpy / torch (not gguf): f16 and bf16 exact."""
    if kind == "F16":
        return x.astype(np.float16).astype(np.float32)
    if kind == "BF16":
        return torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    return x


def assert_tensor(t, want: np.ndarray, name: str) -> None:
    got = read_back(t)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    kind = t.tensor_type.name
    if kind == "Q8_0":
        # q8_0: blocks of 32, int8 codes times one scale d = max|x| / 127 kept in fp16: rounding to the code
        # costs half a step, the scale's own fp16 rounding (2^-11 relative) up to 127 codes of it
        blocks = want.reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127
        err = np.abs(got.reshape(-1, 32) - blocks)
        assert (err <= step * (0.5 + 127 * 2.0 ** -11) + 1e-9).all(), (name, float((err / (step + 1e-12)).max()))
        assert not np.array_equal(got, want), name       # it was quantized at all
    else:
        np.testing.assert_array_equal(got, rounded(want, kind), err_msg=name)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families")
    return {f: make_family_model(root / f, f) for f in FAMILIES}


def export_folder(src: Path, out: Path, outtype: str) -> Path:
    """The real command's code, in this process (cheap): `export-model SRC -o OUT --gguf TYPE`."""
    from shardconsole.cli.trained_model.export_model import cmd_export_model
    assert cmd_export_model([str(src), "-o", str(out), "--gguf", outtype]) == 0
    return out / f"model-{outtype}.gguf"


def field(reader, key: str):
    return reader.fields[key].contents()


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_reads_back_in_llama_cpps_names_and_layout(family, outtype, folders, tmp_path):
    from transformers import AutoModelForCausalLM
    folder = folders[family]
    path = export_folder(folder, tmp_path / "out", outtype)
    reader = gguf.GGUFReader(path)
    config = json.loads((folder / "config.json").read_text())
    hf = {k: v.detach().float().numpy() for k, v in
          AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict().items()}
    tensors = {t.name: t for t in reader.tensors}
    names = expected_names(family, family in TIED)
    assert set(tensors) == set(names), sorted(set(tensors) ^ set(names))
    for gname, hname in names.items():
        t = tensors[gname]
        want = llama_cpp_layout(family, hname, hf[hname], config)
        if want.ndim == 1 or gname.endswith("norm.weight"):
            assert t.tensor_type.name == "F32", gname     # vectors stay f32 in every file type
        else:
            assert t.tensor_type.name == outtype.upper(), gname
        assert_tensor(t, want, gname)
    assert field(reader, "general.architecture") == ARCH[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_metadata_tokenizer_and_chat_template(family, folders, tmp_path):
    from transformers import AutoTokenizer
    folder = folders[family]
    reader = gguf.GGUFReader(export_folder(folder, tmp_path / "out", "f16"))
    config = json.loads((folder / "config.json").read_text())
    arch = ARCH[family]
    assert field(reader, f"{arch}.context_length") == config["max_position_embeddings"] == 1024
    assert field(reader, f"{arch}.block_count") == 2
    assert field(reader, f"{arch}.embedding_length") == 64
    assert field(reader, f"{arch}.attention.head_count") == 4
    assert field(reader, f"{arch}.attention.head_count_kv") == 2
    rope = config["rope_parameters"]
    theta = rope["full_attention"]["rope_theta"] if family == "gemma3" else rope["rope_theta"]
    assert field(reader, f"{arch}.rope.freq_base") == pytest.approx(theta)
    head_dim = config.get("head_dim") or 16
    if arch in ("llama", "phi3"):
        assert field(reader, f"{arch}.rope.dimension_count") == head_dim
    if "head_dim" in config:
        assert field(reader, f"{arch}.attention.key_length") == config["head_dim"]
    if family == "gemma3":
        assert field(reader, "gemma3.attention.sliding_window") == config["sliding_window"]
        assert field(reader, "gemma3.rope.freq_base_swa") == pytest.approx(rope["sliding_attention"]["rope_theta"])
    tok = AutoTokenizer.from_pretrained(folder)
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"       # a plain ByteLevel pre-tokenizer: GPT-2's split
    assert field(reader, "tokenizer.ggml.tokens") == tok.convert_ids_to_tokens(list(range(config["vocab_size"])))
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert field(reader, "tokenizer.ggml.merges") == [" ".join(m) if isinstance(m, list) else m for m in merges]
    assert field(reader, "tokenizer.ggml.eos_token_id") == tok.eos_token_id
    assert field(reader, "tokenizer.chat_template") == tok.chat_template
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[tok.convert_tokens_to_ids("<|im_end|>")] == gguf.TokenType.CONTROL
    modelfile = (tmp_path / "out" / "Modelfile").read_text().splitlines()
    assert modelfile[0] == "FROM ./model-f16.gguf" and 'PARAMETER stop "<|im_end|>"' in modelfile


def test_llama3_rope_scaling_becomes_rope_freqs(tmp_path):
    """Llama 3.1+'s "llama3" rope scaling is a rope_freqs tensor in llama.cpp: the factors of
    transformers' own _compute_llama3_parameters (inv_freq before / after)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    folder = make_family_model(tmp_path / "llama31", "llama3")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    reader = gguf.GGUFReader(export_folder(folder, tmp_path / "out", "f16"))
    freqs = {t.name: t for t in reader.tensors}["rope_freqs.weight"]
    config = AutoConfig.from_pretrained(folder)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    np.testing.assert_allclose(np.asarray(freqs.data), (base / scaled).numpy(), rtol=1e-5)
    assert len(set(np.round(np.asarray(freqs.data), 4))) > 1        # the scaling differs per frequency here


def _one_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    return lines[0]


def test_what_gguf_cannot_express_is_refused_in_one_line(tmp_path):
    from tokenizers import Tokenizer, pre_tokenizers
    moe = make_family_model(tmp_path / "moe", "qwen3_moe")
    line = _one_line(shardconsole("export-model", str(moe), "-o", str(tmp_path / "a"), "--gguf", "q8_0"))
    assert "Qwen3MoeForCausalLM" in line and "no GGUF export" in line and not (tmp_path / "a").exists()
    llama = make_family_model(tmp_path / "ws", "llama3")
    tok = Tokenizer.from_file(str(llama / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()            # a split llama.cpp has no name for
    tok.save(str(llama / "tokenizer.json"))
    line = _one_line(shardconsole("export-model", str(llama), "-o", str(tmp_path / "b"), "--gguf", "f16"))
    assert "tokenizer.json" in line and "pre-tokenizer" in line and not (tmp_path / "b").exists()


def test_known_split_regexes_get_llama_cpps_names():
    """Llama 3's and Qwen 2's tokenizer.json pre-tokenizers (a Split regex, then ByteLevel without its own)
    are llama.cpp's "llama-bpe" and "qwen2"."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from shardconsole.settings.gguf_kinds import pre_tokenizer_name
    llama3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    for regex, name in ((llama3, "llama-bpe"), (llama3.replace(r"\p{N}{1,3}", r"\p{N}"), "qwen2")):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        assert pre_tokenizer_name(json.loads(tok.to_str()), Path("t")) == name


def _safetensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file
    out: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


def assert_gguf_is_the_folder(path: Path, folder: Path, family: str) -> None:
    """Every tensor of the GGUF at `path` is the Hugging Face folder's own, in llama.cpp's layout."""
    config = json.loads((folder / "config.json").read_text())
    weights = _safetensors(folder)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = expected_names(family, bool(config.get("tie_word_embeddings")))
    assert set(tensors) == set(names), sorted(set(tensors) ^ set(names))
    for gname, hname in names.items():
        assert_tensor(tensors[gname], llama_cpp_layout(family, hname, weights[hname], config), gname)


@pytest.mark.slow
def test_a_runs_export_carries_its_gguf(fsdp_chat_run, tmp_path):
    """`export-model RUN -o OUT --gguf f16`: the Hugging Face export and, beside it, a GGUF of the same
    weights with the chat template the run trained with, and its Modelfile."""
    from transformers import AutoTokenizer
    out = tmp_path / "out"
    res = shardconsole("export-model", str(fsdp_chat_run.run), "-o", str(out), "--gguf", "f16", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "model-f16.gguf (llama" in res.stdout and "Modelfile" in res.stdout, res.stdout
    assert (out / "config.json").is_file() and (out / "Modelfile").is_file()
    assert_gguf_is_the_folder(out / "model-f16.gguf", out, "llama3")
    reader = gguf.GGUFReader(out / "model-f16.gguf")
    assert field(reader, "tokenizer.chat_template") == AutoTokenizer.from_pretrained(out).chat_template


@pytest.mark.slow
def test_export_gguf_at_the_end_of_a_lora_run_holds_the_merged_model(tmp_path):
    """train.export_gguf = "q8_0" on a LoRA run: the GGUF inside train.export_dir is the merged model the
    folder holds (dequantized within q8_0's error), and differs from the base the run started from."""
    model = make_family_model(tmp_path / "qwen2", "qwen2")
    corpus = tmp_path / "text.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the quick brown fox"] * 40))
    export = tmp_path / "export"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"),
                       *[a for s in (f"model.name={model}", f"data.path={corpus}", "data.seq_len=32", "train.steps=3",
                                     "train.method=lora", "lora.target_modules=all-linear", "train.lr=5e-2",
                                     "train.save_final=none", f"train.export_dir={export}", "train.export_gguf=q8_0")
                         for a in ("--set", s)], timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert (export / "Modelfile").read_text().startswith("FROM ./model-q8_0.gguf\n")
    assert_gguf_is_the_folder(export / "model-q8_0.gguf", export, "qwen2")
    base, merged = _safetensors(model), _safetensors(export)
    assert not np.allclose(base["model.layers.0.self_attn.q_proj.weight"],
                           merged["model.layers.0.self_attn.q_proj.weight"], atol=1e-3)    # the adapters are in


def test_export_gguf_is_refused_before_launch(tmp_path):
    """train.export_gguf without train.export_dir, or on a family GGUF cannot hold: one line, no run folder."""
    line = _one_line(shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "r1"),
                                  "--set", "train.export_gguf=q8_0"))
    assert "train.export_gguf" in line and "export_dir" in line and not (tmp_path / "r1").exists()
    moe = make_family_model(tmp_path / "moe", "qwen3_moe")
    line = _one_line(shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "r2"),
                                  "--set", f"model.name={moe}", "--set", f"train.export_dir={tmp_path / 'x'}",
                                  "--set", "train.export_gguf=f16"))
    assert "train.export_gguf" in line and "Qwen3MoeForCausalLM" in line and not (tmp_path / "r2").exists()
