"""The Hugging Face folder around the exported weights: the model class built from the run's model.name,
save_pretrained's sharded safetensors, config and generation config, the tokenizer files, the README."""

from __future__ import annotations

import math
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.export_model.checkpoint import Checkpoint, ExportError
from shardconsole.settings.data import prompt_format as prompt_file
from shardconsole.settings.models import ModelSpec, human_count
from shardconsole.runlog.protocol import DataSummary, DecodeError, Eval, decode
from shardconsole.runlog.runfolder import RunFolder

# What a model folder's tokenizer may consist of: the same list as train.export_dir's (imports torch,
# as this module's callers already have).
from shardconsole.backends.checkpoint.hf_export import copy_tokenizer  # noqa: E402


# ---------------------------------------------------------------------------------------------------
# Building the Hugging Face model around the weights

def hf_config(spec: ModelSpec):
    """The config the ranks built the model from (backends/modeling.hf_config), without their run-time
    switches: a folder's own config.json (architecture and all) or the catalog's Llama shape."""
    from shardconsole.backends.model.modeling import transformers_config
    return transformers_config(spec)


def build_model(config, state: dict, dtype, source: Path):
    """The Hugging Face model on the meta device, its parameters then set to the checkpoint's tensors
    (no random init, no second copy in memory). Tied embeddings: the output head is the embedding."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = set(_tied_keys(model))
    state = {k: v.to(dtype) for k, v in state.items() if not (k in tied and _tie_target(model, k) in state)}
    expected = set(model.state_dict())
    missing = sorted(expected - set(state) - tied)
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        what = "; ".join(f"{label} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                         for label, keys in (("missing", missing), ("unexpected", unexpected)) if keys)
        raise ExportError(f"{source}: the checkpoint does not fit {type(model).__name__} built from the run's "
                          f"model.name ({what}); was the model folder changed after the run?")
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[-1].strip()
        raise ExportError(f"{source}: the checkpoint does not fit the run's model.name: {first}") from None
    if tied:
        model.tie_weights()
    return model


def _tied_keys(model) -> list[str]:
    """Keys that are views of another parameter when the config ties them (lm_head.weight -> the embedding)."""
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return []
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return list(keys) if isinstance(keys, dict) else list(keys)


def _tie_target(model, key: str) -> str:
    keys = getattr(model, "_tied_weights_keys", None)
    return keys.get(key, "") if isinstance(keys, dict) else "model.embed_tokens.weight"


# ---------------------------------------------------------------------------------------------------
# The README

def last_eval(run: RunFolder, up_to_step: int) -> Eval | None:
    """The run's last eval loss at or before the exported step (a later one describes other weights)."""
    best = None
    try:
        lines = run.metrics.read_bytes().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        if b'"eval"' not in line:
            continue
        try:
            msg = decode(line)
        except DecodeError:
            continue
        # not a NaN: ORPO's held-out loss was NaN before issue 65, and a README saying so helps no one
        if isinstance(msg, Eval) and msg.loss is not None and math.isfinite(msg.loss) and msg.step <= up_to_step:
            best = msg
    return best


def _last_of(run: RunFolder, kind: bytes, cls: type):
    try:
        lines = run.metrics.read_bytes().splitlines()
    except FileNotFoundError:
        return None
    found = None
    for line in lines:
        if kind in line:
            try:
                msg = decode(line)
            except DecodeError:
                continue
            found = msg if isinstance(msg, cls) else found
    return found


def add_prompt_format(run: RunFolder, folder: Path) -> str:
    """Give the export the chat template the run rendered its chats with, so `apply_chat_template` on it
    prompts as the run trained. A tokenizer's own template came with its files; the plain one the ranks
    use for a tokenizer without one (backends/data/corpus.py) is written as chat_template.jinja, which
    transformers' tokenizers read. Returns what the README says of it."""
    from shardconsole.backends.data.corpus import PLAIN_TEMPLATE, PLAIN_TEMPLATE_NAME
    data = _last_of(run, b'"data"', DataSummary)
    if data is not None and prompt_file.raw_prompts(data.format, data.template):
        prompt_file.write_raw(folder)
        return f"{prompt_file.RAW_WORDS} (said in {prompt_file.FILE})"
    if data is None or not data.template:
        return "none (the run trained on no chats or instructions)"
    if data.template != PLAIN_TEMPLATE_NAME:
        return f"the {data.template}, copied with the tokenizer"
    if not (folder / "tokenizer_config.json").is_file():
        return f"{PLAIN_TEMPLATE_NAME} (`User: ...` / `Assistant: ...` lines); no tokenizer to carry it"
    (folder / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    return (f"{PLAIN_TEMPLATE_NAME} (`User: ...` / `Assistant: ...` lines), the one the run trained with, "
            f"written as chat_template.jinja: `tokenizer.apply_chat_template` renders it")


def readme_text(*, title: str, run: RunFolder, cfg: C.RunConfig, ckpt: Checkpoint, spec: ModelSpec,
                architecture: str, n_params: int, dtype_name: str, shards: int, tokenizer: str,
                ev: Eval | None, prompt_format: str = "", load: list[str] | None = None) -> str:
    backend = ("FSDP2" if cfg.parallel.backend == "fsdp" else f"DeepSpeed ZeRO stage {cfg.deepspeed.stage}")
    eval_line = (f"{ev.loss:.4f} at step {ev.step} (mean over {ev.tokens:,} held-out tokens under loss)" if ev
                 else "none was recorded (set data.eval_fraction or data.eval_path, and train.eval_every)")
    if ev and ev.pairs:     # a preference loss is a mean over pairs
        tokens = f", {ev.tokens:,} answer tokens under loss" if ev.tokens else ""   # 0: a run of before issue 65
        eval_line = (f"{ev.loss:.4f} at step {ev.step} ({cfg.train.objective} loss, mean over {ev.pairs:,} held-out "
                     f"{'records' if ev.kl is not None else 'pairs'}{tokens})")     # KTO's are unpaired records
    preset = run.preset.read_text().rstrip()
    return "\n".join([
        f"# {title}",
        "",
        f"Exported by `shardconsole export-model` from run `{run.run_id}` ({run.path.resolve()}), "
        f"checkpoint of step {ckpt.step} (train.steps = {cfg.train.steps}).",
        "",
        f"- model: {spec.name} ({architecture}, {human_count(n_params)} parameters)",
        f"- trained with: {backend}, train.method {cfg.train.method}, compute dtype {cfg.precision.dtype}, master weights "
        f"{cfg.precision.master_dtype}, {cfg.parallel.nnodes * cfg.parallel.nproc_per_node} rank(s)",
        f"- weights: {dtype_name}, {shards} safetensors file(s)",
        f"- tokenizer: {tokenizer}",
        *([f"- prompt format: {prompt_format}"] if prompt_format else []),
        f"- last eval loss: {eval_line}",
        "",
        "## Load",
        "",
        "```python",
        *(load or ["from transformers import AutoModelForCausalLM",
                   f"model = AutoModelForCausalLM.from_pretrained({title!r})"]),
        "```",
        "",
        "## The run's settings (its preset.toml)",
        "",
        "```toml",
        preset,
        "```",
        "",
    ])


def write_folder(model, spec: ModelSpec, folder: Path, max_shard_size: int) -> int:
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()        # the command reports in one line when done
    folder.mkdir()
    if spec.path is not None and (Path(spec.path) / "generation_config.json").is_file():
        # the folder's own sampling defaults and stop tokens, not ones derived from config.json
        model.generation_config = GenerationConfig.from_pretrained(spec.path, local_files_only=True)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if spec.path is not None:
        copy_tokenizer(Path(spec.path), folder)
    return len(list(folder.glob("*.safetensors")))
