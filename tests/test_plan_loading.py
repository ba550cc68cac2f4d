"""The planner's "loading" moment: the host RAM of loading a model folder's weights (plan/loading.py),
against folders made here: a real tiny one (tests/hf_fixtures.py) and 7B-shaped ones whose
model.safetensors holds only a header (the planner reads the header, never the tensors)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from shardconsole import plan as PL
from shardconsole.cli import main as cli
from shardconsole.settings import config as C
from shardconsole.settings.models import CATALOG, resolve

GiB = 2**30
# eight H200s and 32 GiB of host RAM: enough for eight FSDP2 ranks training 7B, not for rank 0's fp32 copy
NODE8 = PL.Hardware(gpus=8, gpu_memory_bytes=150_754_820_096, host_memory_bytes=32 * GiB)
SEVEN_B = CATALOG["7b"]


def _llama_shapes(c: dict) -> dict[str, list[int]]:
    """A Llama checkpoint's tensors, as transformers names and shapes them."""
    h, i, v, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    out = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for n in range(L):
        p = f"model.layers.{n}."
        out.update({p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
                    p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, h],
                    p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
                    p + "mlp.down_proj.weight": [h, i], p + "input_layernorm.weight": [h],
                    p + "post_attention_layernorm.weight": [h]})
    return out


def _count(shapes: dict[str, list[int]]) -> int:
    n = 0
    for shape in shapes.values():
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


def header_folder(folder: Path, config: dict, dtype: str = "BF16") -> tuple[Path, int]:
    """A model folder whose model.safetensors is a header alone (dtypes and shapes of every tensor), and
    the number of parameters it names."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"],
                                                    "model_type": "llama"}))
    shapes = _llama_shapes(config)
    header = {k: {"dtype": dtype, "shape": s, "data_offsets": [0, 0]} for k, s in shapes.items()}
    blob = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    return folder, _count(shapes)


def estimate(model: str, *sets: str, hw: PL.Hardware = NODE8) -> PL.Estimate:
    cfg = C.build({"model": {"name": model}, "data": {"seq_len": 2048}, "parallel": {"device": "cuda"}},
                  "test", ["parallel.nproc_per_node=8", "memory.activation_checkpointing=true", *sets])
    return PL.estimate(cfg, resolve(cfg.model.name), hw)


def test_a_folder_with_weights_has_a_loading_moment_a_catalog_size_and_a_config_alone_do_not(tmp_path):
    folder, n = header_folder(tmp_path / "7b-bf16", SEVEN_B)
    loaded = estimate(str(folder))
    assert loaded.loading is not None and "loading" in loaded.host_phases
    # FSDP2 without offload: every rank holds only its process while rank 0 holds the folder in fp32
    # (4 bytes a parameter, converted from the file's bf16), so the node's load is training's + 4 N
    assert loaded.host_phases["loading"] - loaded.host_phases["training"] == 4 * n
    catalog = estimate("7b")
    assert catalog.loading is None and "loading" not in catalog.host_phases
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    assert estimate(str(bare)).loading is None                   # no weights: random init, nothing loaded
    assert catalog.host_phases["training"] == loaded.host_phases["training"]


def test_a_host_too_small_for_the_load_but_not_for_training_is_refused_naming_the_load(tmp_path):
    folder, n = header_folder(tmp_path / "7b-bf16", SEVEN_B)
    trains = estimate("7b")
    assert trains.fits, trains.verdict                          # the same model from random init fits here
    e = estimate(str(folder))
    assert not e.fits and e.host_peak_phase == "loading"
    # the node at the load: its ranks (training's + rank 0's fp32 copy) + the same launcher and front end
    others = trains.host_peak_bytes - trains.host_phases[trains.host_peak_phase]
    assert e.host_peak_bytes == trains.host_phases["training"] + 4 * n + others
    assert "while loading the model folder" in e.verdict and "rank 0 loads the whole model in fp32" in e.verdict
    assert "deepspeed.stage = 3" in e.verdict                   # what the code offers against it
    assert "GPU needs" not in e.verdict
    # the parts say which rank holds the copy, and add up to the peak
    assert e.host_parts["fp32 copy of the folder (from_pretrained, rank 0 only)"] == 4 * n
    assert sum(e.host_parts.values()) == e.host_peak_bytes
    roomy = estimate(str(folder), hw=PL.Hardware(8, NODE8.gpu_memory_bytes, 64 * GiB))
    assert roomy.fits and roomy.host_peak_phase == "loading"     # then the load is still the node's peak


def test_a_folder_already_in_the_loaded_dtype_is_read_in_place(tmp_path):
    bf16, n = header_folder(tmp_path / "bf16", SEVEN_B, "BF16")
    fp32, _ = header_folder(tmp_path / "fp32", SEVEN_B, "F32")
    # FSDP2 loads fp32: an fp32 file is mapped, not copied (its pages are page cache)
    assert estimate(str(fp32)).host_phases["loading"] == estimate("7b").host_phases["training"]
    assert estimate(str(fp32)).loading.mapped_bytes == (fp32 / "model.safetensors").stat().st_size
    # QLoRA loads bf16 on every rank: a bf16 file in place, an fp32 one converted (2 bytes a parameter each)
    q = ("train.method=qlora", "precision.dtype=bf16")
    assert estimate(str(fp32), *q).loading.each["bf16 copy of the folder (from_pretrained, whole)"] == 2 * n
    assert estimate(str(bf16), *q).loading.each["bf16 copy of the folder (from_pretrained, whole)"] == 0


def test_zero_0_to_2_load_on_every_rank_and_zero_3_a_tensor_at_a_time(tmp_path):
    folder, n = header_folder(tmp_path / "7b-bf16", SEVEN_B)
    ds = ("parallel.backend=deepspeed", "parallel.launcher=torchrun", "precision.dtype=bf16")
    z2 = estimate(str(folder), *ds, "deepspeed.stage=2")
    assert "build" not in z2.host_phases          # the folder's load is ZeRO-2's model built on the CPU
    assert z2.loading.who == "every rank" and z2.host_phases["loading"] > 8 * 4 * n
    assert not z2.fits and "fewer ranks per node (parallel.nproc_per_node)" in z2.verdict
    z3 = estimate(str(folder), *ds, "deepspeed.stage=3")
    # rank 0 reads one tensor and casts it: the largest is the [32000, 4096] embedding, fp32 and bf16
    assert z3.loading.rank0 == {"one tensor read and cast (largest, rank 0)": 32000 * 4096 * (4 + 2)}
    assert z3.host_peak_phase != "loading"
    # CPU ranks gather every parameter on the host (fp32 here), and the heap keeps freed blocks: the model
    cpu = estimate(str(folder), "parallel.backend=deepspeed", "parallel.launcher=torchrun", "deepspeed.stage=3",
                   "parallel.device=cpu", "precision.dtype=fp32")
    assert cpu.loading.each["parameters gathered on the host (CPU ranks, freed blocks kept)"] == 4 * n


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    from tests.hf_fixtures import make_hf_model
    return make_hf_model(tmp_path_factory.mktemp("tiny") / "model", dtype="bfloat16")


def test_plan_shows_the_load_of_a_real_folder_in_text_and_json(tiny_bf16, capsys):
    from safetensors.torch import load_file
    n = sum(t.numel() for t in load_file(str(tiny_bf16 / "model.safetensors")).values())
    argv = ["plan", "--preset", "tiny-cpu", "--set", f"model.name={tiny_bf16}", "--host-memory", "64GiB"]
    assert cli.main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["loading"]["who"] == "rank 0"
    assert doc["loading"]["rank0_adds"] == {"fp32 copy of the folder (from_pretrained, rank 0 only)": 4 * n}
    assert doc["loading"]["mapped_bytes"] == (tiny_bf16 / "model.safetensors").stat().st_size
    assert "loading" in doc["host_phases"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "loading the model folder (rank 0 reads it whole in fp32)" in out
    assert cli.main(["plan", "--preset", "tiny-cpu", "--json", "--host-memory", "64GiB"]) == 0
    catalog = json.loads(capsys.readouterr().out)
    assert catalog["loading"] is None and "loading" not in catalog["host_phases"]


def test_preflight_refuses_a_launch_whose_load_does_not_fit_and_says_so(tmp_path, monkeypatch):
    from shardconsole.session import preflight
    from shardconsole.settings import resolve as R
    folder, _ = header_folder(tmp_path / "7b-bf16", SEVEN_B)
    monkeypatch.setattr(PL, "detect_hardware", lambda: NODE8)
    sets = ["parallel.device=cuda", "parallel.nproc_per_node=8", "memory.activation_checkpointing=true",
            "data.seq_len=2048"]
    catalog = R.resolve("tiny-cpu", [*sets, "model.name=7b"])
    preflight.check_host_memory(catalog, resolve("7b"))         # random init: fits, no refusal
    r = R.resolve("tiny-cpu", [*sets, f"model.name={folder}"])
    with pytest.raises(C.ConfigError, match="while loading the model folder .*rank 0 loads the whole model in fp32"):
        preflight.check_host_memory(r, resolve(str(folder)))
