"""`shardconsole export-model RUN [--step N] -o OUT_DIR [--dtype bf16|fp32]`: a run's checkpoint as a
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
import errno
import os
import re
import shutil
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.export_model.checkpoint import (ExportError, check_exportable, check_finite, pick_checkpoint,
                                                  read_model_state)
from shardconsole.runlog.checkpoint_files import STEP_PREFIX, make_private
from shardconsole.settings.models import ModelError, human_count, resolve
from shardconsole.runlog.runfolder import RunFolder

__all__ = ["ExportError", "cmd_export_model"]
DTYPES = ("fp32", "bf16")
PARTIAL = ".partial-"       # .<OUT>.partial-<pid>: an export being written (renamed to OUT when whole)
_PARTIAL_NAME = re.compile(r"^\..+\.partial-(\d+)$")


def _sweep_partials(parent: Path) -> None:
    """Remove the half-written folders of exports that were killed (kill -9, the OOM killer) before their
    `finally` ran: `.<OUT>.partial-<pid>` whose pid is no export-model running now."""
    import psutil
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for path in entries:
        m = _PARTIAL_NAME.match(path.name)
        if not m or not path.is_dir() or path.is_symlink():
            continue
        try:
            if "export-model" in psutil.Process(int(m.group(1))).cmdline():
                continue            # another export writing now
        except (psutil.Error, ValueError, OverflowError):
            pass
        shutil.rmtree(path, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardconsole export-model",
        description="Write a Hugging Face model folder from a run's checkpoint (FSDP2 or DeepSpeed ZeRO), "
                    "on any machine: no GPU and no particular rank count needed.")
    ap.add_argument("run", metavar="RUN",
                    help="the run folder (holds preset.toml), or its run id (or a unique part of one) under the runs root")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
    ap.add_argument("-o", "--output", dest="out", type=Path, required=True, metavar="OUT_DIR",
                    help="the folder to write (must not exist, or be empty)")
    ap.add_argument("--dtype", choices=DTYPES, default=None,
                    help="dtype of the written weights (default: the checkpoint's master weights' own dtype)")
    ap.add_argument("--adapter", action="store_true",
                    help="a LoRA / QLoRA run: write peft's adapter folder (PeftModel.from_pretrained(base, OUT_DIR)) "
                         "instead of the merged model")
    ap.add_argument("--gguf", choices=("f16", "bf16", "q8_0"), default=None, metavar="TYPE",
                    help="also write model-TYPE.gguf (llama.cpp, Ollama, LM Studio; TYPE f16, bf16 or q8_0) and an "
                         "Ollama Modelfile into OUT_DIR; RUN may then be a Hugging Face model folder, converted alone")
    ap.add_argument("--max-shard-size", default="5GB",
                    help="largest safetensors file, e.g. 5GB or 500MB (default 5GB)")
    return ap


def _disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT, also as safetensors' writer reports it (a SafetensorError naming the OS error)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(e)
    return (f"os error {errno.ENOSPC})" in text or f"os error {errno.EDQUOT})" in text
            or "StorageFull" in text)


def _write_failure(e: Exception, out: Path, tmp: Path, need: int) -> ExportError | None:
    """The one line a failed write of the export folder is told as, or None for a failure of another kind."""
    if _disk_full(e):
        shutil.rmtree(tmp, ignore_errors=True)        # first, so the free space is what is there
        free = shutil.disk_usage(out.parent).free if out.parent.exists() else 0
        return ExportError(f"-o {out}: writing failed: disk full (no space left on device): the export needs "
                           f"{C.format_size(need)}, {C.format_size(free)} free on {out.parent}; nothing was "
                           f"left behind")
    if isinstance(e, OSError):
        return ExportError(f"-o {out}: writing failed: {e}")
    # safetensors' writer raises its own SafetensorError for an OSError underneath
    if type(e).__name__ != "SafetensorError":
        return None
    why = (str(e).splitlines() or ["SafetensorError"])[0][:200]
    return ExportError(f"-o {out}: writing failed: {why}; nothing was left behind")


def _refuse_inside_runs(out: Path, run: RunFolder, cfg: C.RunConfig) -> None:
    """-o inside another run's folder (by any path: runlog/checkpoint_files.other_run_folder), whose resume,
    pruning and `runs` take its files as its own; or inside one of this run's step folders, which is pruned
    or replaced with the export in it."""
    from shardconsole.runlog.checkpoint_files import other_run_folder
    inside = other_run_folder(out, run.path)
    if inside is not None:
        raise ExportError(f"-o {out}: inside run folder {inside}, whose files are its own; pick a folder outside "
                          f"every other run's folder")
    ckpts = run.checkpoints(cfg.train.checkpoint_dir)
    try:
        where = out.resolve().relative_to(ckpts.resolve()).parts
    except (ValueError, OSError, RuntimeError):
        where = ()
    if where and where[0].startswith(STEP_PREFIX):     # a save, or one being written or set aside
        raise ExportError(f"-o {out}: inside the checkpoint {ckpts / where[0]}, which is pruned or replaced with "
                          f"what is in it; pick a folder outside it")


def cmd_export_model(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.gguf and args.adapter:
        raise ExportError("--gguf with --adapter: the GGUF holds the merged model; leave out --adapter")
    from shardconsole.export_model import gguf_export
    if args.gguf and gguf_export.is_model_folder(Path(args.run)):
        print(gguf_export.folder_to_gguf(Path(args.run), args.out, args.gguf))
        return 0
    from shardconsole.history.index import find_run
    try:
        args.run_dir = find_run(args.run)
    except ValueError as e:
        raise ExportError(str(e)) from None
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
    if shard_bytes <= 0:
        # 0 wrote a file a tensor (hundreds of files for a 7B), silently
        raise ExportError(f"--max-shard-size {args.max_shard_size}: a size above 0, e.g. 5GB (the default) or 500MB")
    cfg = C.load(run.preset)
    _refuse_inside_runs(out, run, cfg)
    try:
        spec = resolve(cfg.model.name)
    except ModelError as e:
        raise ExportError(f"{run.preset}: [model] name: {e} (the export takes the model's config and "
                          f"tokenizer from it)") from None
    check_exportable(cfg, spec, args.adapter, run.preset)     # before torch's import: refusals in well under a second
    ckpt = pick_checkpoint(run.checkpoints(cfg.train.checkpoint_dir), args.step, cfg.parallel.backend)

    from shardconsole.quiet_libraries import quiet_libraries
    quiet_libraries()
    import torch

    from shardconsole.export_model import adapters, hf_folder
    state = read_model_state(ckpt)
    check_finite(state, ckpt)
    stored = {v.dtype for v in state.values() if v.is_floating_point()}
    dtype_name = args.dtype or ("bf16" if stored == {torch.bfloat16} else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    if cfg.adapters:     # the checkpoint holds the adapters; the base is the model folder's
        model = adapters.build(cfg, spec, state, dtype, ckpt.path, merged=not args.adapter)
    else:
        model = hf_folder.build_model(hf_folder.hf_config(spec), state, dtype, ckpt.path)
    n_params = adapters.trained_count(model) if args.adapter else sum(p.numel() for p in model.parameters())

    # The name cut so that a 250-character OUT still leaves room for the hidden folder's prefix and suffix.
    tmp = out.parent / f".{out.name[:200]}{PARTIAL}{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep_partials(out.parent)
        shards = (adapters.write_adapter(model, spec, tmp) if args.adapter
                  else hf_folder.write_folder(model, spec, tmp, shard_bytes))
        tokenizer = (f"copied from {spec.path}" if spec.path and spec.has_tokenizer else
                     f"none: {spec.path} holds none" if spec.path else
                     f"none: the catalog model {spec.name!r} has no tokenizer (it trains on token ids)")
        (tmp / "README.md").write_text(hf_folder.readme_text(
            title=out.name, run=run, cfg=cfg, ckpt=ckpt, spec=spec, architecture=type(model).__name__,
            n_params=n_params, dtype_name=dtype_name, shards=shards, tokenizer=tokenizer,
            ev=hf_folder.last_eval(run, ckpt.step), prompt_format=hf_folder.add_prompt_format(run, tmp),
            load=adapters.load_lines(out.name, str(spec.path)) if args.adapter else None))
        gguf_line = f", {gguf_export.add_gguf(tmp, args.gguf, out.name)}" if args.gguf else ""
        if cfg.train.checkpoint_private:
            make_private(tmp)           # the trained model, readable by its owner alone (as the checkpoints)
        if out.exists():
            out.rmdir()                 # checked empty above; a rename cannot replace a folder with files
        os.replace(tmp, out)
    except Exception as e:     # a full disk, a read-only parent: nothing half-written is left behind
        named = _write_failure(e, out, tmp, n_params * (2 if dtype_name == "bf16" else 4))
        if named is None:
            raise
        raise named from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    what = "adapter folder of" if args.adapter else type(model).__name__ + ","
    print(f"wrote {out}: {what} {human_count(n_params)} parameters in {dtype_name}, "
          f"{shards} safetensors file(s){gguf_line}, from step {ckpt.step} of {run.path}")
    return 0
