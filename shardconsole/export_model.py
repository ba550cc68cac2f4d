"""`shardconsole export-model RUN_DIR [--step N] -o OUT_DIR [--dtype bf16|fp32]`: a run's checkpoint as a
Hugging Face model folder (config.json, generation_config.json, sharded safetensors with the model's own
key names, the tokenizer when the model came from a folder, a README with the run's settings and last
eval loss) that `AutoModelForCausalLM.from_pretrained` loads.

It runs on any machine, without GPUs and without the run's world size: an FSDP2 checkpoint (DCP) is read
in one process without a process group, a DeepSpeed one is merged by DeepSpeed's own zero_to_fp32. Only
the model entries are read: the optimizer, data position and RNG states stay where they are.

A tool, not a front end: it imports torch, transformers and deepspeed, but only inside the command, so
`shardconsole --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from shardconsole import config as C
from shardconsole.models import ModelError, ModelSpec, human_count, resolve
from shardconsole.protocol import DecodeError, Eval, decode
from shardconsole.runfolder import RunFolder

# The ranks train CausalLMLoss(lm): every checkpoint key is the Hugging Face model's own key under "lm.".
PREFIX = "lm."
# What a model folder's tokenizer may consist of (fast and slow tokenizers, chat templates).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
TOKENIZER_DIRS = ("additional_chat_templates",)
DTYPES = ("fp32", "bf16")


class ExportError(ModelError):
    """One line for the user: the CLI prints it after `shardconsole: error:` and exits 2."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    kind: str          # "dcp" (FSDP2) or "deepspeed"


# ---------------------------------------------------------------------------------------------------
# Finding the checkpoint

def step_folders(root: Path) -> list[tuple[int, Path]]:
    """step_<N> folders, newest first (step_<N>.partial ones are saves still being written, or killed)."""
    found = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit():
                found.append((int(p.name[5:]), p))
    return sorted(found, reverse=True)


def pick_checkpoint(root: Path, step: int | None, backend: str) -> Checkpoint:
    """The newest complete checkpoint, or the one of `step`; complete as resume judges it (the manifest's
    files all there at their sizes: backends/checkpoints.why_incomplete)."""
    from shardconsole.backends.checkpoints import why_incomplete
    kind = "dcp" if backend == "fsdp" else "deepspeed"
    folders = step_folders(root)
    if not folders:
        raise ExportError(f"{root}: no checkpoint to export (a run writes one at the end with "
                          f"train.save_final = true, or every train.checkpoint_every steps)")
    if step is not None:
        path = dict(folders).get(step)
        if path is None:
            steps = ", ".join(str(n) for n, _ in folders[:8])
            raise ExportError(f"--step {step}: no checkpoint of that step in {root} (steps there: {steps})")
        why = why_incomplete(path, backend)
        if why:
            raise ExportError(f"--step {step}: {path} is not a complete checkpoint: {why}")
        return Checkpoint(step, path, kind)
    for n, path in folders:
        why = why_incomplete(path, backend)
        if why is None:
            return Checkpoint(n, path, kind)
        print(f"shardconsole: skipping {path}: {why}; trying the one before", file=sys.stderr)
    raise ExportError(f"{root}: no complete checkpoint to export (every step folder there is incomplete)")


# ---------------------------------------------------------------------------------------------------
# Reading the model's weights

@contextlib.contextmanager
def _no_code_from_pickles(allowed: list):
    """Every torch.load inside (DeepSpeed's zero_to_fp32 passes weights_only=False itself) builds only
    tensors, containers and the `allowed` classes: a crafted checkpoint file cannot run code."""
    import torch.serialization
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


def read_model_state(ckpt: Checkpoint) -> dict:
    """The trained weights under the Hugging Face model's own key names, as the checkpoint keeps them
    (fp32 or bf16 master weights)."""
    import pickle
    try:
        raw = _read_dcp(ckpt.path) if ckpt.kind == "dcp" else _read_deepspeed(ckpt.path)
    except (pickle.UnpicklingError, OSError, EOFError) as e:
        raise ExportError(f"{ckpt.path}: cannot read the checkpoint: {str(e).strip().splitlines()[0]}") from None
    bad = [k for k in raw if not k.startswith(PREFIX)]
    if bad or not raw:
        raise ExportError(f"{ckpt.path}: not a shardconsole model checkpoint (expected every weight under "
                          f"{PREFIX!r}, found {bad[0] if bad else 'no weights'!r})")
    return {k[len(PREFIX):]: v for k, v in raw.items()}


def _read_dcp(path: Path) -> dict:
    """FSDP2's torch.distributed.checkpoint, read whole in this process: DCP reassembles each tensor from
    however many ranks wrote it, so neither the world size nor a process group is needed. Only the
    "model" entries; the .metadata pickle through the ranks' own restricted reader."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from shardconsole.backends.fsdp_step import SafeReader
    with warnings.catch_warnings(), _no_code_from_pickles([]):
        # "torch.distributed is unavailable or uninitialized, assuming ... a single process": that is the point
        warnings.simplefilter("ignore")
        state = _load_state_dict_from_keys({"model"}, storage_reader=SafeReader(str(path)))
    model = state.get("model")
    if not isinstance(model, dict):
        raise ExportError(f"{path}: this DCP checkpoint holds no 'model' entry (was it written by shardconsole?)")
    return model


def _read_deepspeed(path: Path) -> dict:
    """engine.save_checkpoint's layout. Stages 1-3 keep the master weights partitioned in the optimizer
    files, merged by DeepSpeed's zero_to_fp32 (with bf16 masters, bf16_master_weights_and_grads, the
    "fp32" groups it reads are those bf16 masters, returned as they are). zero_to_fp32 fails on stage 0
    (no partitioned masters): in fp32 the module's own weights are what the optimizer updates; in bf16
    or fp16 the fp32 masters sit in the optimizer's state inside the model states file."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")     # merging runs on the host; no GPU is touched
    try:
        import torch
        from deepspeed.utils import zero_to_fp32
    except ImportError as e:
        raise ExportError(f"{path}: a DeepSpeed checkpoint; reading it needs the deepspeed package ({e})") from None
    tag = (path / "latest").read_text().strip()
    folder = path / tag
    states = sorted(folder.glob("*model_states.pt"))
    if not states:
        raise ExportError(f"{folder}: no *model_states.pt file: the DeepSpeed checkpoint is incomplete")
    allowed = _deepspeed_classes()
    with _no_code_from_pickles(allowed):
        meta = torch.load(states[0], map_location="cpu", weights_only=True, mmap=True)
    ds_cfg = meta.get("ds_config") or {}
    stage = int((ds_cfg.get("zero_optimization") or {}).get("stage", 0))
    half = [k for k in ("bf16", "fp16") if (ds_cfg.get(k) or {}).get("enabled")]
    if stage == 0:
        return _stage0_masters(meta, folder, half[0]) if half else dict(meta["module"])
    # zero_to_fp32 prints its progress on stdout and draws tqdm bars on stderr: the command's own output is
    # one line, and an error still surfaces as the exception it raises.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            _no_code_from_pickles(allowed):
        try:
            return dict(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag))
        except (ValueError, FileNotFoundError) as e:
            raise ExportError(f"{folder}: DeepSpeed cannot merge this ZeRO-{stage} checkpoint: {e}") from None


def _deepspeed_classes() -> list:
    """The classes DeepSpeed's own checkpoint files hold besides tensors (the ranks' resume allows the same)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _stage0_masters(meta: dict, folder: Path, half: str) -> dict:
    """Stage 0 in bf16/fp16: DeepSpeed's (B)F16 optimizer keeps one fp32 master per parameter in
    `fp32_groups`, in the module's parameter order, without names. The order is trusted only when every
    master has its parameter's shape and rounds to exactly the half-precision weight the module holds."""
    import torch
    module = meta["module"]
    names = [k for k in module if k not in set(meta.get("buffer_names") or ())]
    groups = (meta.get("optimizer") or {}).get("fp32_groups")
    masters = [t for group in groups for t in group] if isinstance(groups, list) else []
    if len(masters) != len(names) or not all(
            isinstance(t, torch.Tensor) and t.shape == module[n].shape and torch.equal(t.to(module[n].dtype), module[n])
            for t, n in zip(masters, names)):
        raise ExportError(f"{folder}: DeepSpeed stage 0 in {half}: the fp32 master weights in its optimizer state "
                          f"do not map onto the model's parameters; export from a checkpoint of deepspeed.stage "
                          f"1-3 or FSDP2")
    return dict(zip(names, masters))


# ---------------------------------------------------------------------------------------------------
# Building the Hugging Face model around the weights

def hf_config(spec: ModelSpec):
    """The config the ranks built the model from (backends/modeling.hf_config), without their run-time
    switches: a folder's own config.json (architecture and all) or the catalog's Llama shape."""
    from transformers import AutoConfig, LlamaConfig
    if spec.path is not None:
        return AutoConfig.from_pretrained(spec.path, local_files_only=True)
    return LlamaConfig(**spec.config)


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
        if isinstance(msg, Eval) and msg.loss is not None and msg.step <= up_to_step:
            best = msg
    return best


def readme_text(*, title: str, run: RunFolder, cfg: C.RunConfig, ckpt: Checkpoint, spec: ModelSpec,
                architecture: str, n_params: int, dtype_name: str, shards: int, tokenizer: str,
                ev: Eval | None) -> str:
    backend = ("FSDP2" if cfg.parallel.backend == "fsdp" else f"DeepSpeed ZeRO stage {cfg.deepspeed.stage}")
    eval_line = (f"{ev.loss:.4f} at step {ev.step} (mean over {ev.tokens:,} held-out tokens under loss)" if ev
                 else "none was recorded (set data.eval_fraction or data.eval_path, and train.eval_every)")
    preset = run.preset.read_text().rstrip()
    return "\n".join([
        f"# {title}",
        "",
        f"Exported by `shardconsole export-model` from run `{run.run_id}` ({run.path.resolve()}), "
        f"checkpoint of step {ckpt.step} (train.steps = {cfg.train.steps}).",
        "",
        f"- model: {spec.name} ({architecture}, {human_count(n_params)} parameters)",
        f"- trained with: {backend}, compute dtype {cfg.precision.dtype}, master weights "
        f"{cfg.precision.master_dtype}, {cfg.parallel.nnodes * cfg.parallel.nproc_per_node} rank(s)",
        f"- weights: {dtype_name}, {shards} safetensors file(s)",
        f"- tokenizer: {tokenizer}",
        f"- last eval loss: {eval_line}",
        "",
        "## Load",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        f"model = AutoModelForCausalLM.from_pretrained({title!r})",
        "```",
        "",
        "## The run's settings (its preset.toml)",
        "",
        "```toml",
        preset,
        "```",
        "",
    ])


# ---------------------------------------------------------------------------------------------------
# The command

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardconsole export-model",
        description="Write a Hugging Face model folder from a run's checkpoint (FSDP2 or DeepSpeed ZeRO), "
                    "on any machine: no GPU and no particular rank count needed.")
    ap.add_argument("run_dir", type=Path, help="the run folder (holds preset.toml)")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
    ap.add_argument("-o", "--output", dest="out", type=Path, required=True, metavar="OUT_DIR",
                    help="the folder to write (must not exist, or be empty)")
    ap.add_argument("--dtype", choices=DTYPES, default=None,
                    help="dtype of the written weights (default: the checkpoint's master weights' own dtype)")
    ap.add_argument("--max-shard-size", default="5GB",
                    help="largest safetensors file, e.g. 5GB or 500MB (default 5GB)")
    return ap


def cmd_export_model(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    run = RunFolder(args.run_dir)
    if not run.preset.is_file():
        raise ExportError(f"{args.run_dir}: not a run folder (no {run.preset.name})")
    out: Path = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"-o {out}: exists and is not an empty folder; pick a new one")
    try:
        shard_bytes = C.parse_size(args.max_shard_size)
    except ValueError as e:
        raise ExportError(f"--max-shard-size {args.max_shard_size}: {e}") from None
    cfg = C.load(run.preset)
    try:
        spec = resolve(cfg.model.name)
    except ModelError as e:
        raise ExportError(f"{run.preset}: [model] name: {e} (the export takes the model's config and "
                          f"tokenizer from it)") from None
    ckpt = pick_checkpoint(run.checkpoints(cfg.train.checkpoint_dir), args.step, cfg.parallel.backend)

    import torch
    state = read_model_state(ckpt)
    stored = {v.dtype for v in state.values() if v.is_floating_point()}
    dtype_name = args.dtype or ("bf16" if stored == {torch.bfloat16} else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    model = build_model(hf_config(spec), state, dtype, ckpt.path)
    n_params = sum(p.numel() for p in model.parameters())

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        shards = _write(model, spec, tmp, shard_bytes)
        tokenizer = (f"copied from {spec.path}" if spec.path and spec.has_tokenizer else
                     f"none: {spec.path} holds none" if spec.path else
                     f"none: the catalog model {spec.name!r} has no tokenizer (it trains on token ids)")
        (tmp / "README.md").write_text(readme_text(
            title=out.name, run=run, cfg=cfg, ckpt=ckpt, spec=spec, architecture=type(model).__name__,
            n_params=n_params, dtype_name=dtype_name, shards=shards, tokenizer=tokenizer,
            ev=last_eval(run, ckpt.step)))
        if out.exists():
            out.rmdir()                 # checked empty above; a rename cannot replace a folder with files
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out}: {type(model).__name__}, {human_count(n_params)} parameters in {dtype_name}, "
          f"{shards} safetensors file(s), from step {ckpt.step} of {run.path}")
    return 0


def _write(model, spec: ModelSpec, folder: Path, max_shard_size: int) -> int:
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()        # the command reports in one line when done
    folder.mkdir()
    if spec.path is not None and (Path(spec.path) / "generation_config.json").is_file():
        # the folder's own sampling defaults and stop tokens, not ones derived from config.json
        model.generation_config = GenerationConfig.from_pretrained(spec.path, local_files_only=True)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if spec.path is not None:
        src = Path(spec.path)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, folder / name)
        for name in TOKENIZER_DIRS:
            if (src / name).is_dir():
                shutil.copytree(src / name, folder / name)
    return len(list(folder.glob("*.safetensors")))


def main() -> None:   # python -m shardconsole.export_model, for debugging without the CLI
    try:
        sys.exit(cmd_export_model(sys.argv[1:]))
    except (C.ConfigError, ModelError) as e:
        print(f"shardconsole: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
