"""Will it fit? Peak GPU memory (largest rank) and host RAM of a run, before it is launched.

Pure functions of the settings (RunConfig), the model's shape (ModelSpec, from its config: nothing is
built and torch is not imported) and the hardware (Hardware). The model follows what the ranks of this
package really do (backends/engine/fsdp.py, backends/engine/deepspeed.py, backends/rank/common.py), part by part:

  GPU   parameters, gradients and optimizer states (where the backend keeps them, in which dtype,
        divided by the shard group), gathered (unsharded) parameters and prefetch, activations saved
        for backward (per decoder layer, by micro-batch, sequence length, dtype and attention kernel;
        with checkpointing only each layer's input plus one recomputed layer), the chunked loss
        (logits in 4096-token chunks, recomputed in backward), communication buffers (FSDP2
        reduce-scatter; DeepSpeed's reduce bucket, prefetch bucket, live parameters), the caching
        allocator's slack, and the CUDA context (what NVML shows beyond the allocator).
  host  each rank's baseline RSS (Python, torch, CUDA, NCCL), the model build path, offloaded
        parameters, gradients and optimizer states (pinned buffers are rounded up to a power of two
        by PyTorch's CachingHostAllocator), and the launcher and front-end processes.

The peak is not the sum of every part: gradients appear as activations are freed, so the GPU model
evaluates the moments that can set the peak (end of forward, loss backward, last and first layer's
backward, end of backward, optimizer step, model build) and reports the parts alive at the largest
one, plus the pools the caching allocator keeps for the communication streams.

Every constant says where it comes from: the sources (PyTorch, DeepSpeed, transformers), or a
measurement of benchmarks/plan_calibrate.py on the H200 test machine
(benchmarks/data/plan_calibration.json; docs/PLANNER.md has the comparison and what is fitted).

Where it lives (every name is re-exported here, so `from shardconsole import plan as PL; PL.estimate`
works; to monkeypatch a name that the planner itself looks up, patch the module that uses it):

  constants.py          every constant and where it comes from (KiB/MiB/GiB, CUDA_CONTEXT_BYTES,
                        allocator slack, base RSS, DTYPE_BYTES, SPEED_FACTOR, ...)
  shapes.py             Shapes (the model's shape from its config), shape_numel, shard_numel, pow2_ceil
  machine.py            Hardware, detect_hardware
  activation_memory.py  what autograd saves: layer_activation_bytes_per_token and the compiled and
                        eager variants, Activations, activations
  rank.py               RankMemory: one rank's memory at each moment of a step
  fsdp_rank.py          fsdp_rank_memory: an FSDP2 rank
  deepspeed_rank.py     ds_sub_groups, deepspeed_rank_memory: a DeepSpeed ZeRO rank
  estimator.py          Estimate, estimate (peaks, budgets, verdict), _cpu_ranks, model_states,
                        _verdict, replace_cfg, host_peak_line (compile_workers_bytes re-exported)
  host.py               HostPeak, host_peak (the node's host peak over the moments),
                        compile_workers_bytes
  loading.py            Loading, loading: the host RAM of loading a model folder's weights (rank 0's fp32
                        copy under FSDP2, every rank's under ZeRO-0/1/2 and QLoRA), folder_weights
  saves.py              Saves, saves: a checkpoint's, a model save's and the export's bytes, the disk
                        total with keep_checkpoints, what a save adds to host RAM
  fit.py                STRATEGIES, EXTRA_STRATEGIES, FIT_EXTRA_ROWS, speed_score, fit_table (FitRow),
                        settings_that_fit (Candidate), _strategy_cfg, _spec_of, toml_value
  speed/model.py        how fast: a step's parts (GPU FLOPs, PCIe, the host step) from measured and
                        published rates, the critical path, tokens/s and the time to train.steps (predict)
  speed/host.py         the host's side of an offloaded step: PCIe copies, the host step at HostRates
  speed/cards.py        the cards `plan --card` knows: published bf16 rate, memory, PCIe generation
  speed/book.py         the speed book: what this machine measured, ranking with the speed model

Nothing here imports torch (tests/test_plan.py::test_planner_imports_no_torch).
"""

from __future__ import annotations

from shardconsole.plan.activation_memory import (Activations, activations, compiled_layer_activation_bytes_per_token,
                                                 eager_attention_bytes_per_sample, layer_activation_bytes_per_token)
from shardconsole.plan.constants import (ALLOCATOR_SLACK_FIXED, ALLOCATOR_SLACK_FRACTION, COMPILE_SIDECAR_BYTES,
                                         COMPILE_WORKER_BYTES, CUBLAS_WORKSPACE_BYTES, SAVE_FIXED_BYTES,
                                         CUDA_CONTEXT_BYTES, DS_BUILD_BASE_RSS, DS_SUB_GROUP_SIZE, DTYPE_BYTES,
                                         FRONTEND_RSS, FSDP_FP16_OFFLOAD_HOST_PER_PARAM, GPU_DRIVER_RESERVED_BYTES,
                                         HOST_USABLE_FRACTION, LAUNCHER_RSS, LOSS_CHUNK_TOKENS, RANK_BASE_RSS,
                                         RANK_BASE_RSS_CPU, REQUIRED_FIXED, REQUIRED_FRAGMENTATION, SPEED_FACTOR,
                                         GiB, KiB, MiB)
from shardconsole.plan.deepspeed_rank import deepspeed_rank_memory, ds_sub_groups
from shardconsole.plan.estimator import (Estimate, compile_workers_bytes, estimate,
                                         gpu_peak_text, host_peak_line, model_states, replace_cfg)
from shardconsole.plan.saves import Saves, disk_peak, save_final_of, saves, schedule
from shardconsole.plan.saves import text_lines as saves_text_lines
from shardconsole.plan.fit import (EXTRA_STRATEGIES, FIT_EXTRA_ROWS, STRATEGIES, Candidate, FitRow,
                                   toml_value, fit_table, settings_that_fit, speed_score)
from shardconsole.plan.fsdp_rank import fsdp_rank_memory
from shardconsole.plan.machine import Hardware, detect_hardware
from shardconsole.plan.rank import RankMemory
from shardconsole.plan.shapes import Shapes, shape_numel, shard_numel, pow2_ceil

__all__ = [
    # constants
    "KiB", "MiB", "GiB", "CUDA_CONTEXT_BYTES", "GPU_DRIVER_RESERVED_BYTES", "ALLOCATOR_SLACK_FRACTION",
    "ALLOCATOR_SLACK_FIXED", "REQUIRED_FRAGMENTATION", "REQUIRED_FIXED", "CUBLAS_WORKSPACE_BYTES",
    "LOSS_CHUNK_TOKENS", "RANK_BASE_RSS", "DS_BUILD_BASE_RSS", "RANK_BASE_RSS_CPU", "LAUNCHER_RSS", "FRONTEND_RSS",
    "FSDP_FP16_OFFLOAD_HOST_PER_PARAM", "HOST_USABLE_FRACTION", "DS_SUB_GROUP_SIZE", "DTYPE_BYTES", "SPEED_FACTOR",
    "COMPILE_SIDECAR_BYTES", "COMPILE_WORKER_BYTES", "SAVE_FIXED_BYTES",
    # shapes, machine
    "Shapes", "shape_numel", "shard_numel", "pow2_ceil", "Hardware", "detect_hardware",
    # activation_memory
    "layer_activation_bytes_per_token", "compiled_layer_activation_bytes_per_token",
    "eager_attention_bytes_per_sample", "Activations", "activations",
    # rank, fsdp_rank, deepspeed_rank
    "RankMemory", "fsdp_rank_memory", "ds_sub_groups", "deepspeed_rank_memory",
    # estimator
    "Estimate", "estimate", "model_states", "replace_cfg", "host_peak_line",
    "compile_workers_bytes", "gpu_peak_text",
    # saves
    "Saves", "saves", "schedule", "disk_peak", "save_final_of", "saves_text_lines",
    # fit
    "STRATEGIES", "EXTRA_STRATEGIES", "FIT_EXTRA_ROWS", "speed_score", "FitRow", "fit_table",
    "Candidate", "settings_that_fit", "toml_value",
]
