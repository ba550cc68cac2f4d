"""Today's model families train as transformers defines them (issue 59).

Each family is a toy folder made here from transformers' own config class (tests/family_fixtures.py). The
model is built as a rank builds it (backends/engine/fsdp.build: the meta device, FSDP2's sharding,
to_empty, buffers restored, the folder's weights broadcast from rank 0), in one process over gloo, and its
loss is compared with transformers' own `model(ids, labels=ids).loss` on the same batch. The real
multi-rank runs (learning against a bare transformers loop, LoRA, export) are tests/test_family_runs.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardconsole.backends.engine import fsdp, fsdp_checkpoint
from shardconsole.backends.model import modeling
from shardconsole.backends.rank import common
from shardconsole.plan.shapes import Shapes
from shardconsole.runlog.stream import MetricsWriter
from shardconsole.settings import config as C
from shardconsole.settings import models
from tests.family_fixtures import FAMILIES, family_config, make_family_model

FAMILY_NAMES = list(FAMILIES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: make_family_model(root / f, f) for f in FAMILY_NAMES}


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _rank(tmp_path, model: str, *sets: str) -> common.Rank:
    cfg = C.build({"model": {"name": model}, "parallel": {"device": "cpu", "nproc_per_node": 1},
                   "precision": {"dtype": "fp32"}}, overrides=list(sets))
    return common.Rank(cfg, tmp_path, "t", 0, 0, 1, torch.device("cpu"), MetricsWriter(None, "t", 0),
                       models.resolve(model))


def _batch(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


def _reference(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_rank_built_model_has_transformers_loss(family, checkpointing, folders, tmp_path, one_rank):
    """The loss of the model a rank builds from the folder equals transformers' own, fp32, 1e-5: the
    chunked and the fused loss, with and without activation checkpointing (a Gemma 3 folder built with
    a garbage embedding scale trained 40 steps to an export that had learned nothing, exit 0)."""
    ref = _reference(folders[family])
    ids = _batch(ref.config.get_text_config().vocab_size)
    with torch.no_grad():
        want = float(ref(ids, labels=ids).loss)
    for loss in ("chunked", "fused"):
        built = fsdp.build(_rank(tmp_path, str(folders[family]), f"memory.loss={loss}",
                                 f"memory.activation_checkpointing={str(checkpointing).lower()}"))
        built.model.eval()
        with torch.no_grad():
            got = float(built.model(ids[:, :-1], ids[:, 1:]))
        assert math.isfinite(want) and got == pytest.approx(want, abs=1e-5), (family, loss)


@pytest.mark.parametrize("family", ["gemma3", "llama3", "qwen3", "phi3"])
def test_random_init_starts_as_the_family_defines(family, tmp_path, one_rank):
    """A folder without weights trains from random init: its vectors start where the family's own init puts
    them (Gemma's (1 + w) norms at 0, Llama's x * w at 1, biases 0) and its buffers are the model's
    (Gemma's embedding scale sqrt(hidden), the rotary frequencies), not a Llama rule's."""
    from transformers import AutoModelForCausalLM
    folder = make_family_model(tmp_path / family, family, weights=False)
    built = fsdp.build(_rank(tmp_path, str(folder)))
    own = AutoModelForCausalLM.from_config(family_config(family, 384))
    ours = {n.removeprefix("lm."): p.full_tensor() for n, p in built.model.named_parameters()}
    for name, p in own.named_parameters():
        if p.dim() == 1:
            assert torch.equal(ours[name], p.detach()), name
    persistent = set(own.state_dict())
    theirs = {n: b for n, b in own.named_buffers() if n not in persistent}
    assert theirs, "every family here has rotary frequencies"
    mine = dict(built.model.named_buffers())
    for name, b in theirs.items():
        assert torch.equal(mine[f"lm.{name}"], b), name


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_planner_counts_each_family_as_transformers_does(family, folders):
    """The planner's count (settings.models, plan.shapes: from config.json, nothing built) equals the
    parameters transformers builds: qk-norm, Gemma's four norms a layer, qwen2's q/k/v biases, experts."""
    spec = models.resolve(str(folders[family]))
    want = sum(p.numel() for p in _reference(folders[family]).parameters())
    assert spec.n_params == want
    assert Shapes.of(spec).n_params == want


# The published parameter counts of the releases the catalog copies (their model cards / safetensors index).
RELEASED = {"llama3-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360, "qwen3-14b": 14_768_307_200,
            "mistral-small-24b": 23_572_403_200}


@pytest.mark.parametrize("name", list(RELEASED))
def test_catalog_shapes_are_the_releases(name):
    """Each of today's catalog names plans at its release's size, and transformers builds exactly the
    model the planner counts from it (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM
    spec = models.resolve(name)
    assert spec.n_params == RELEASED[name] == Shapes.of(spec).n_params
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(modeling.transformers_config(spec))
    assert sum(p.numel() for p in lm.parameters()) == RELEASED[name]
    assert spec.config["num_key_value_heads"] == 8 < spec.config["num_attention_heads"]


def test_final_logit_softcapping_survives_both_losses():
    """Gemma 2's final_logit_softcapping (c * tanh(z / c)) is in the chunked and the fused loss, value and
    gradient: equal to transformers' loss on the same model (a loss from raw logits would train another)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    lm = Gemma2ForCausalLM(Gemma2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                        vocab_size=300, final_logit_softcapping=0.5,
                                        attn_implementation="eager")).float()
    with torch.no_grad():
        lm.lm_head.weight.normal_(0.0, 1.0)      # logits of several units: where the cap bends them
    ids = _batch(300)
    want = lm(ids, labels=ids).loss
    want.backward()
    want_grad = lm.lm_head.weight.grad.clone()
    for loss in ("chunked", "fused"):
        lm.zero_grad()
        got = modeling.CausalLMLoss(lm, loss=loss)(ids[:, :-1], ids[:, 1:])
        got.backward()
        assert float(got) == pytest.approx(float(want), abs=1e-5), loss
        torch.testing.assert_close(lm.lm_head.weight.grad, want_grad, rtol=1e-4, atol=1e-6)
    plain = modeling.CausalLMLoss(lm)
    plain.rule.softcap = None
    assert abs(float(plain(ids[:, :-1], ids[:, 1:])) - float(want)) > 1e-2    # the cap matters here


def test_logit_scale_survives_the_loss():
    """Cohere's logit_scale multiplies the logits in its forward: the same in ours."""
    from transformers import CohereConfig, CohereForCausalLM
    torch.manual_seed(0)
    lm = CohereForCausalLM(CohereConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                                        logit_scale=0.25)).float()
    ids = _batch(300)
    want = float(lm(ids, labels=ids).loss)
    for loss in ("chunked", "fused"):
        assert float(modeling.CausalLMLoss(lm, loss=loss)(ids[:, :-1], ids[:, 1:])) == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_never_see_each_other(family, attn, folders):
    """Three documents packed in one row with positions restarting (data.cross_document_attention =
    false, as the ranks pass them: no attention mask at all): changing the middle one leaves the other
    two's logits unchanged, and each equals that document run alone. Sliding-window layers included."""
    ref = _reference(folders[family])
    ref.config._attn_implementation = attn
    model = modeling.CausalLMLoss(ref)
    vocab = ref.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, vocab, (n,), generator=gen) for n in (9, 12, 11)]

    def hidden(parts):
        ids = torch.cat(parts)[None]
        pos = torch.cat([torch.arange(len(p)) for p in parts])[None]
        with torch.no_grad():
            return model.lm.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]

    packed = hidden(docs)
    changed = hidden([docs[0], torch.randint(0, vocab, (12,), generator=gen), docs[2]])
    a, b = len(docs[0]), len(docs[0]) + len(docs[1])
    torch.testing.assert_close(changed[:a], packed[:a], rtol=0, atol=1e-6)
    torch.testing.assert_close(changed[b:], packed[b:], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[a:b], packed[a:b])
    torch.testing.assert_close(packed[b:], hidden([docs[2]]), rtol=1e-5, atol=1e-5)


def test_a_qlora_model_gives_its_save_state(tmp_path, one_rank):
    """QLoRA's save reads the model's state through torch's get_model_state_dict, which resolves every
    state-dict key to an attribute: bitsandbytes' "weight.absmax"-style keys failed every QLoRA save
    ("'Params4bit' object has no attribute 'absmax'", an 8B folder on an H100 at its last step). Built here
    as a rank builds it (4-bit base from a Llama 3 folder, adapters, FSDP2 over the rest, on bitsandbytes'
    CPU backend): the checkpoint's model state is the adapters, loadable back."""
    pytest.importorskip("bitsandbytes", reason="the qlora extra: pip install 'shardconsole[qlora]'")
    from shardconsole.backends.model import adapters, qlora
    folder = make_family_model(tmp_path / "llama3", "llama3")
    r = _rank(tmp_path, str(folder), "train.method=lora", "precision.dtype=bf16")
    hf_cfg = modeling.hf_config(r.spec, r.cfg)
    model = qlora.build(r, hf_cfg)
    assert qlora.quantised_params(model)
    fsdp.shard_model(r, model, ignored=qlora.quantised_params(model))
    state = fsdp_checkpoint.model_state(r, model)
    assert state and all(adapters.is_trained(k) for k in state)
    assert set(state) == {n for n, p in model.named_parameters() if p.requires_grad}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj", "qkv_proj,gate_up_proj", "o_proj"])
def test_lora_counts_what_peft_makes_trainable_in_each_family(family, targets, folders):
    """The planner's LoRA count (plan/lora.py) is peft's own for every family: Phi-3's fused qkv_proj and
    gate_up_proj, an MoE's experts that are no Linear. A target naming no layer of the family is refused
    before launch (preflight), where peft would refuse it only in the ranks."""
    from peft import get_peft_model
    from shardconsole.backends.model.adapters import lora_config
    from shardconsole.plan import lora
    cfg = C.build({"model": {"name": str(folders[family])}, "train": {"method": "lora"},
                   "lora": {"rank": 8, "target_modules": targets}})
    shapes = Shapes.of(models.resolve(cfg.model.name))
    problem = lora.target_problem(cfg, shapes)
    try:
        peft_model = get_peft_model(_reference(folders[family]), lora_config(cfg))
    except ValueError as e:
        assert "not found" in str(e) or "Target modules" in str(e)
        assert problem is not None and "name no linear layer" in problem
        return
    assert problem is None
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert lora.trainable_params(cfg, shapes) == trainable, (family, targets)


def test_a_lora_target_the_family_lacks_is_one_line_before_launch(folders, tmp_path):
    from tests.conftest import shardconsole
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"),
                       "--set", f"model.name={folders['phi3']}", "--set", "train.method=lora",
                       "--set", "lora.target_modules=q_proj,v_proj")
    assert res.returncode == 2 and not (tmp_path / "run").exists()
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--set lora.target_modules" in lines[0] and "qkv_proj" in lines[0], res.stderr
