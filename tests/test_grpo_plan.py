"""The planner's GRPO sampling moment (issue 61): the GPU peak is the larger of sampling (the weights and
optimizer state, plus the KV cache of micro_batch x generations rows of data.seq_len, the prefill and the
sampler's tensors) and training. A model of full-width attention heads (its KV cache twice its checkpointed
activations) at 6k tokens on a 24 GiB card: the same rows trained as SFT fit, GRPO's sampling does not, and
`plan` and the launch's fit check both say so, naming the KV cache."""

from __future__ import annotations

import json

import pytest

from conftest import shardconsole
from shardconsole.settings import resolve as R
from shardconsole.session.gpu_checks import gpu_overrun

# 24 layers, 16 heads of 256 (q 4096 wide over a 2048 residual), no grouped KV heads: 2 x 4096 x 2 bytes of KV
# cache a token a layer
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
          "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "intermediate_size": 5504,
          "num_hidden_layers": 24, "vocab_size": 32000, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
REWARD = "def r(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n"


def _sets(tmp_path, objective: str, micro_batch: int) -> list[str]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "rewards.py").write_text(REWARD)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Say cat:"}\n')
    return [f"model.name={model}", f"data.path={tmp_path / 'prompts.jsonl'}", f"grpo.reward={tmp_path}/rewards.py:r",
            "data.seq_len=6144", "grpo.max_new_tokens=256", "grpo.generations=8", f"train.objective={objective}",
            f"train.micro_batch={micro_batch}"]


def _plan(sets: list[str]) -> dict:
    res = shardconsole("plan", "--preset", "3090-7b-qlora", "--card", "rtx4090", "--host-memory", "64GiB", "--json",
                       *[a for s in sets for a in ("--set", s)])
    assert res.returncode in (0, 3), res.stderr
    return json.loads(res.stdout)


def test_a_grpo_run_whose_sampling_is_over_the_card_does_not_fit_though_its_training_would(tmp_path):
    sft = _plan(_sets(tmp_path, "sft", 8))              # the same 8 rows of 6144 tokens, trained
    assert sft["fits"] and "sampling" not in sft["gpu_phases"], sft["verdict"]
    grpo = _plan(_sets(tmp_path, "grpo", 1))            # 1 prompt x 8 generations
    phases = grpo["gpu_phases"]
    training = max(v for k, v in phases.items() if k != "sampling")
    assert training <= max(sft["gpu_phases"].values()) * 1.05          # training alone: what SFT fits
    assert grpo["gpu_peak_phase"] == "sampling" and phases["sampling"] > training * 1.3, phases
    assert not grpo["fits"] and "sampling: KV cache" in grpo["verdict"], grpo["verdict"]
    assert "lower grpo.generations" in grpo["verdict"]
    # the KV cache: 2 (K, V) x 24 layers x 4096 x 2 bytes x 8 rows x 6144 tokens; the weights held beside it
    assert grpo["gpu_parts"]["sampling: KV cache"] == 2 * 24 * 4096 * 2 * 8 * 6144
    assert any(k.startswith("frozen base") for k in grpo["gpu_parts"]), grpo["gpu_parts"]


def test_the_launch_refuses_it_before_building_anything(tmp_path):
    sets = ["parallel.device=cuda", "memory.gpu_memory_limit=24GiB"]
    ok = R.resolve("3090-7b-qlora", [*_sets(tmp_path, "sft", 8), *sets])
    assert gpu_overrun(ok) is None
    refused = gpu_overrun(R.resolve("3090-7b-qlora", [*_sets(tmp_path, "grpo", 1), *sets]))
    assert refused is not None and "sampling: KV cache" in str(refused), refused


def test_full_grpo_with_a_kl_counts_its_frozen_copy_and_does_not_fit_where_it_cannot(tmp_path):
    """3b fully fine-tuned on a 24 GiB card (bf16 shards): at beta 0 it fits; the KL's frozen copy of the
    starting weights (2 bytes a parameter, whole on the one rank) puts it over, and the launch refuses it."""
    base = [*_sets(tmp_path, "grpo", 1)[1:], "model.name=3b", "data.seq_len=1024"]
    res = shardconsole("plan", "--preset", "3090-3b-adamw8bit", "--card", "rtx4090", "--host-memory", "64GiB",
                       "--json", *[a for s in base for a in ("--set", s)])
    beta0 = json.loads(res.stdout)
    assert beta0["fits"] and "grpo reference (frozen copy)" not in beta0["gpu_parts"], beta0["verdict"]
    res = shardconsole("plan", "--preset", "3090-3b-adamw8bit", "--card", "rtx4090", "--host-memory", "64GiB",
                       "--json", *[a for s in [*base, "grpo.beta=0.04"] for a in ("--set", s)])
    kl = json.loads(res.stdout)
    assert kl["gpu_parts"]["grpo reference (frozen copy)"] == 2 * kl["n_params"]
    assert kl["gpu_peak_bytes"] > beta0["gpu_peak_bytes"] + 2 * kl["n_params"] * 0.9 and not kl["fits"]
    # two ranks of ZeRO-3 each hold half of it in the compute dtype; ZeRO-2 all of it
    for stage, share in ((3, 2), (2, 1)):
        res = shardconsole("plan", "--preset", "3090-3b-adamw8bit", "--card", "h100", "--host-memory", "256GiB",
                           "--json", *[a for s in [*base, "grpo.beta=0.04", "parallel.backend=deepspeed",
                                                   f"deepspeed.stage={stage}", "parallel.nproc_per_node=2", "optim.name=adamw",
                                                   "optim.step_in_backward=false"]
                                       for a in ("--set", s)])
        d = json.loads(res.stdout)
        assert d["gpu_parts"]["grpo reference (frozen copy)"] == -(-2 * d["n_params"] // share), stage
    sets = ["parallel.device=cuda", "memory.gpu_memory_limit=24GiB", "grpo.beta=0.04"]
    refused = gpu_overrun(R.resolve("3090-3b-adamw8bit", [*base, *sets]))
    assert refused is not None and "does not fit" in str(refused), refused


def _grpo_speed(tmp_path, prompts: list, *extra: str):
    from shardconsole.plan.machine import Hardware
    from shardconsole.plan.speed import model as SM
    from shardconsole.plan.speed.cards import CARDS
    from shardconsole.settings.models import resolve as model_of
    (tmp_path / "rewards.py").write_text(REWARD)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    cfg = R.resolve("3090-fsdp", [f"data.path={data}", "data.tokenizer=bytes", "data.seq_len=512",
                                  "train.objective=grpo", f"grpo.reward={tmp_path}/rewards.py:r", "grpo.generations=4",
                                  "grpo.max_new_tokens=128", "train.micro_batch=2", "train.grad_accum=3",
                                  "parallel.nproc_per_node=2", *extra]).cfg
    two = Hardware(gpus=2, gpu_memory_bytes=141 * 10**9, host_memory_bytes=256 * 2**30, gpu_name="NVIDIA H200", cpus=16)
    return SM.predict(cfg, model_of(cfg.model.name), two, card=CARDS["h200"])


def test_grpo_tokens_per_s_counts_what_the_step_line_counts(tmp_path):
    """Issue 63: the run's step line counts every prompt's and completion's tokens (prompts x generations x
    (prompt + completion)); the plan counted micro_batch x data.seq_len, 131 tokens/s for an issue-61 run that
    trained ~2,300 tokens a step. Now: micro_batch 2 x grad_accum 3 x 2 ranks x 4 generations rows of the
    prompts' 22 bytes (issue 61's "Q: what is 12 + 34? A:", tokenizer bytes) and 128 completion tokens (their
    longest, as the decode time is), and the step carries the decode."""
    prompt = "Q: what is 12 + 34? A:"
    p = _grpo_speed(tmp_path, [prompt] * 8)
    assert len(prompt.encode()) == 22
    assert p.tokens_per_s * p.step_s == pytest.approx(2 * 3 * 2 * 4 * (22 + 128), rel=1e-6)
    assert any("7,200 tokens a step" in n and "~22 tokens" in n for n in p.notes), p.notes
    # 128 more decode steps a micro-batch each read every weight at least once (2 bytes, at no more than the
    # H200's 4.8 TB/s): the step grows by at least that, 3 micro-batches a step
    longer = _grpo_speed(tmp_path, [prompt] * 8, "grpo.max_new_tokens=256")
    assert longer.step_s - p.step_s > 3 * 128 * 2 * _n_params_1b() / 4.8e12
    assert longer.tokens_per_s * longer.step_s == pytest.approx(2 * 3 * 2 * 4 * (22 + 256), rel=1e-6)
    # prompts as message lists count their contents and some template tokens a turn; a prompt longer than
    # data.seq_len - max_new_tokens is cut to it, as the ranks cut it
    chat = _grpo_speed(tmp_path, [[{"role": "user", "content": "x" * 100}]] * 4)
    per_row = chat.tokens_per_s * chat.step_s / (2 * 3 * 2 * 4) - 128
    assert 100 < per_row < 100 + 32, per_row
    cut = _grpo_speed(tmp_path, ["y" * 2000] * 4)
    assert cut.tokens_per_s * cut.step_s == pytest.approx(2 * 3 * 2 * 4 * 512, rel=1e-6)


def _n_params_1b() -> int:
    from shardconsole.settings.models import resolve as model_of
    return model_of("1b").n_params
