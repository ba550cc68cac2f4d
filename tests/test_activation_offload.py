"""memory.activation_offload (issue 62): the checkpointed layers' saved inputs kept on the host between
forward and backward give the same loss and gradients as without (fp32, 1e-6), through the model a rank
builds; the planner moves those bytes from the GPU to the host."""

from __future__ import annotations

import pytest
import torch

from shardconsole.backends.model import activation_offload, modeling
from shardconsole.settings import config as C
from shardconsole.settings import models


def _model(checkpointing: bool = True):
    from transformers import AutoModelForCausalLM
    spec = models.resolve("tiny")
    hf = modeling.hf_config(spec, C.RunConfig())
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(hf).float()
    if checkpointing:
        modeling.apply_checkpointing(lm, "full", compiled=False)
    return modeling.CausalLMLoss(lm)


def test_offloaded_inputs_give_the_same_loss_and_gradients():
    ids = torch.randint(0, 256, (4, 1025), generator=torch.Generator().manual_seed(1))   # 1 MiB+ a layer input
    plain, offloaded = _model(), _model()
    offloaded.offload = activation_offload.Offloader(torch.device("cpu"))
    losses = []
    for model in (plain, offloaded):
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        losses.append(loss)
    assert offloaded.offload.copied_bytes >= 2 * 4 * 1024 * 64 * 4      # both layers' inputs went to the host
    assert float(losses[0]) == pytest.approx(float(losses[1]), abs=1e-6)
    for (name, a), b in zip(plain.named_parameters(), offloaded.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=name)


def test_offload_needs_checkpointing_and_the_planner_moves_the_bytes():
    from shardconsole import plan
    with pytest.raises(C.ConfigError, match="activation_checkpointing"):
        C.build({"memory": {"activation_offload": True}})
    base = {"model": {"name": "llama3-8b"}, "train": {"method": "lora", "micro_batch": 1},
            "data": {"seq_len": 32768}, "precision": {"dtype": "bf16"},
            "memory": {"activation_checkpointing": True, "gpu_memory_limit": "24GiB"}}
    hw = plan.Hardware(gpus=1, gpu_memory_bytes=80 * 2**30, host_memory_bytes=128 * 2**30)
    spec = models.resolve("llama3-8b")
    kept = plan.estimate(C.build(base), spec, hw)
    moved = plan.estimate(C.build({**base, "memory": {**base["memory"], "activation_offload": True}}), spec, hw)
    inputs = 32 * 32768 * 4096 * 2          # 32 layers' inputs, bf16: 8 GiB
    assert kept.gpu_peak_bytes - moved.gpu_peak_bytes > 0.8 * inputs - 2 * 32768 * 4096 * 2
    assert moved.host_peak_bytes - kept.host_peak_bytes >= inputs


@pytest.mark.parametrize("method", ["full", "lora"])
def test_tiled_mlp_gives_the_same_loss_and_gradients(method):
    """memory.mlp_tile_tokens: each layer's MLP computed 300 tokens at a time (4 x 512 tokens: seven tiles,
    the last one short), checkpointed, with or without adapters: the loss and every trained gradient equal
    the whole MLP's (fp32; the tiles sum the weight gradients in another order)."""
    from shardconsole.backends.model import adapters, tiled_mlp
    ids = torch.randint(0, 256, (4, 513), generator=torch.Generator().manual_seed(2))
    models_ = [_model(), _model()]
    if method == "lora":
        cfg = C.build({"train": {"method": "lora"}, "lora": {"rank": 4}})
        for m in models_:
            torch.manual_seed(3)        # peft draws lora_A from the global generator: the same adapters
            adapters.inject(m.lm, cfg)
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(n)))
    assert tiled_mlp.apply(modeling.decoder_layers(models_[1].lm), 300) == 2
    losses = []
    for model in models_:
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        losses.append(float(loss))
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    trained = [(n, a, b) for (n, a), b in zip(models_[0].named_parameters(), models_[1].parameters()) if a.requires_grad]
    assert trained and all(a.grad is not None for _, a, _ in trained)
    for name, a, b in trained:
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_tiled_mlp_is_refused_on_deepspeed():
    with pytest.raises(C.ConfigError, match="mlp_tile_tokens"):
        C.build({"parallel": {"backend": "deepspeed"}, "memory": {"mlp_tile_tokens": 4096}})


def test_plan_fit_proposes_the_long_context_settings():
    """`plan --fit --model llama3-8b --seq-len 32768` for LoRA on one 24 GiB card: a GPU-resident base fits
    only with the layer inputs on the host and the MLP in tiles, and then at the edge of the allocator's
    budget (issue 62: that ran out of memory on the H100), so it proposes the frozen base on the host with
    the same two settings, planned with room; no adam-mini for adapters (its states are megabytes)."""
    from tests.conftest import shardconsole
    res = shardconsole("plan", "--fit", "--model", "llama3-8b", "--seq-len", "32768", "--gpus", "1",
                       "--gpu-memory", "24GiB", "--host-memory", "64GiB", "--set", "train.method=lora")
    assert res.returncode == 0, res.stderr
    fastest = next(line for line in res.stdout.splitlines() if line.startswith("fastest:"))
    assert "memory.activation_offload=true" in fastest and "memory.mlp_tile_tokens=4096" in fastest
    settings_part = res.stdout.split("settings that fit", 1)[1]
    assert "fsdp.cpu_offload=true" in fastest and "adam-mini" not in settings_part
    gpu_resident = [line for line in settings_part.splitlines() if "no_shard, checkpointing, layer inputs" in line]
    assert gpu_resident, settings_part         # still listed, after the settings with room
    short = shardconsole("plan", "--fit", "--model", "llama3-8b", "--seq-len", "2048", "--gpus", "1",
                         "--gpu-memory", "24GiB", "--host-memory", "64GiB", "--set", "train.method=lora")
    assert "activation_offload" not in short.stdout      # short sequences: nothing to move
