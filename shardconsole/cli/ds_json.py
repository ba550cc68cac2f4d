"""The CLI commands: `shardconsole export ... --format deepspeed` (cmd_export) and
`shardconsole import FILE.json` (cmd_import), with their argument parsing, file reading and writing."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from shardconsole.settings import config as C
from shardconsole.settings import preset_store, resolve as settings
from shardconsole.ds_json.export import to_ds_config
from shardconsole.ds_json.export_file import file_config
from shardconsole.ds_json.hf_trainer import hf_trainer_config, training_arguments_line
from shardconsole.ds_json.importer import from_ds_config, merge


# ---------------------------------------------------------------------------------------------------
# The CLI commands

def _read_json(path: Path) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise C.ConfigError(f"{path}: key {k!r} appears twice (DeepSpeed rejects duplicate keys)")
            out[k] = v
        return out
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise C.ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise C.ConfigError(f"{path}: is a folder, not a DeepSpeed JSON config") from None
    except UnicodeDecodeError:
        raise C.ConfigError(f"{path}: not a text file (a DeepSpeed config is JSON)") from None
    except OSError as e:
        raise C.ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise C.ConfigError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise C.ConfigError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def _write_text(text: str, out: str | None, force: bool) -> Path | None:
    if out is None or out == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return None
    path = Path(out).expanduser()
    if path.exists() and not force:
        raise C.ConfigError(f"{path}: exists; pass --force to overwrite it")
    return C.write_atomic(path, text)


def cmd_export(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="shardconsole export",
        description="Write the DeepSpeed config (ds_config JSON) of a preset's run, the same for the Hugging Face "
                    "Trainer (\"auto\" placeholders, with the TrainingArguments that fill them), or the resolved "
                    "preset as TOML. Only the file goes to stdout; notes go to stderr.")
    ap.add_argument("--preset", default=settings.DEFAULT_PRESET,
                    help=f"preset name or .toml file (default: {settings.DEFAULT_PRESET}, the one `shardconsole` opens)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="override one setting; repeatable")
    ap.add_argument("--format", choices=("deepspeed", "hf-trainer", "toml"), default="deepspeed")
    ap.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output file")
    args = ap.parse_args(argv)
    overrides = settings.from_cli(args.overrides)
    resolved = settings.resolve(args.preset, overrides)
    note = []
    if args.format != "toml" and resolved.cfg.parallel.backend != "deepspeed":
        # An FSDP run has no ds_config: the file is the one of the DeepSpeed run these settings become.
        resolved = settings.resolve(args.preset, [*overrides, *settings.from_cli(["parallel.backend=deepspeed"])])
        note.append(f"{args.preset} runs FSDP; this is its DeepSpeed equivalent, what "
                    f"`--set parallel.backend=deepspeed` runs")
    cfg, notes = resolved.cfg, resolved.notes
    if args.format == "toml":
        text = preset_store.dumps_preset(cfg)
    elif args.format == "hf-trainer":
        text = json.dumps(hf_trainer_config(cfg), indent=2) + "\n"
    else:
        text = json.dumps(file_config(cfg), indent=2) + "\n"
        if cfg.parallel.device == "auto" and to_ds_config(cfg, device="cpu") != to_ds_config(cfg, device="cuda"):
            note.append("written for GPU ranks (parallel.device = \"auto\"), wherever it is exported; a run "
                        "of these settings on CPU ranks uses torch's AdamW (\"torch_adam\": true) instead")
    for line in note + notes:
        print(f"shardconsole export: {line}", file=sys.stderr)
    written = _write_text(text, args.output, args.force)
    if written:
        print(f"shardconsole export: wrote {written}", file=sys.stderr)
    if args.format == "deepspeed":
        print("shardconsole export: " + ("the \"scheduler\" block is the preset's schedule for your own script; "
              "shardconsole's run applies it in its loop (DeepSpeed's WarmupCosineLR warms up over 2 steps "
              "at least)" if "scheduler" in text else "no \"scheduler\" block: the learning rate is constant, "
              "as DeepSpeed keeps it without one"), file=sys.stderr)
    if args.format == "hf-trainer":
        print("shardconsole export: \"auto\" values are filled by the Trainer from its TrainingArguments; "
              "these give the preset's values and schedule:", file=sys.stderr)
        print(f"  {training_arguments_line(cfg, str(written or 'ds_config.json'))}", file=sys.stderr)
    if args.format != "toml" and cfg.deepspeed.stage == 3 and cfg.deepspeed.stage3_layer_gather:
        print("shardconsole export: deepspeed.stage3_layer_gather is a call, not a config key: in your own "
              "script, call deepspeed.utils.set_z3_leaf_modules(model, [YourDecoderLayer]) before "
              "deepspeed.initialize to gather by layer as shardconsole does", file=sys.stderr)
    return 0


def cmd_import(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="shardconsole import",
        description="Turn a DeepSpeed config (ds_config JSON) into a preset TOML. Says on stderr which keys "
                    "were mapped, which were not, and why.")
    ap.add_argument("ds_config", type=Path, help="the DeepSpeed JSON file")
    ap.add_argument("-o", "--output", default=None, help="preset file to write (default: the TOML to stdout)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output file")
    ap.add_argument("--preset", default=None,
                    help="base preset for what the JSON does not say (model, data, steps; default: the defaults)")
    ap.add_argument("--nproc-per-node", type=int, default=None,
                    help="ranks per node the JSON is meant for (turns train_batch_size into a micro-batch; "
                         "default: the base preset's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="override one setting after the import; repeatable")
    args = ap.parse_args(argv)
    data = _read_json(args.ds_config)
    overrides = settings.from_cli(args.overrides)
    base_path: Path | None
    if args.preset:
        base_path = preset_store.find(args.preset)
        base_raw, base_name = C.load_toml(base_path), base_path.stem
    else:
        base_path, base_raw, base_name = None, {}, "defaults"
    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1:
            raise C.ConfigError(f"--nproc-per-node {args.nproc_per_node}: expected 1 or more")
        base_raw = merge(base_raw, {"parallel": {"nproc_per_node": args.nproc_per_node}})
    base = settings.resolve_doc(base_raw, base_name, base_path, overrides).cfg
    defaults: list[str] = []
    over, mapped, unmapped = from_ds_config(data, str(args.ds_config), world_size=base.world_size, base=base,
                                            defaults=defaults, infer_ranks=args.nproc_per_node is None)
    name = args.ds_config.name
    merged = merge(base.to_dict(), over)
    merged["description"] = f"Imported from {name} by `shardconsole import`" + (
        f" over preset {args.preset}" if args.preset else "")
    # --set wins over the JSON, as it wins over a preset.
    cfg = settings.resolve_doc(merged, name, f"{args.ds_config} (imported)", overrides).cfg
    err = sys.stderr
    print(f"shardconsole import: {name}: mapped {len(mapped)} setting(s):", file=err)
    for line in mapped:
        print(f"  {line}", file=err)
    if defaults:
        print(f"shardconsole import: {name}: not in the file, so DeepSpeed's defaults ({len(defaults)}):", file=err)
        for line in defaults:
            print(f"  {line}", file=err)
    if unmapped:
        print(f"shardconsole import: {name}: not mapped ({len(unmapped)}):", file=err)
        for key, why in unmapped:
            print(f"  {key}: {why}", file=err)
    if args.output is None or args.output == "-":
        sys.stdout.write(preset_store.dumps_preset(cfg))
        sys.stdout.flush()
        return 0
    out = Path(args.output).expanduser()
    if out.exists() and not args.force:
        raise C.ConfigError(f"{out}: exists; pass --force to overwrite it")
    C.write_atomic(out, preset_store.dumps_preset(cfg))
    print(f"shardconsole import: wrote {out}; run it with: shardconsole --preset {out} --headless", file=err)
    return 0
