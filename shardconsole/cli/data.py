"""`shardconsole data --preview N [--random] [--preset NAME|FILE] [--set table.key=value ...] [--json]`:
the first N records of data.path (or a random N) as the model will see them: the chat template applied,
special tokens visible, the tokens under loss marked, each record's token count, and how the records
pack into the first window. The ranks' own tokenizing code makes it, so what is shown is what trains.

Under loss is shown in colour on a terminal and between ⟦ and ⟧ otherwise (--plain forces the markers).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from shardconsole.settings import resolve as settings
from shardconsole.settings.resolve import DEFAULT_PRESET

_LOSS_ON, _LOSS_OFF = "\x1b[1;32m", "\x1b[0m"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="shardconsole data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preview", type=int, nargs="?", const=3, default=3, metavar="N",
                    help="records to show (default 3)")
    ap.add_argument("--random", action="store_true", help="a random N records instead of the first N "
                                                          "(reads the whole file)")
    ap.add_argument("--seed", type=int, default=0, help="--random: the sample's seed")
    ap.add_argument("--preset", default=None, help=f"preset name or .toml file (default: {DEFAULT_PRESET})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE")
    ap.add_argument("--json", action="store_true", help="the preview as one JSON object")
    ap.add_argument("--plain", action="store_true", help="mark tokens under loss with ⟦ ⟧, never colour")
    return ap


def _visible(text: str) -> str:
    return text.replace("\n", "↵\n")


def format_preview(pv, color: bool) -> str:
    on, off = (_LOSS_ON, _LOSS_OFF) if color else ("⟦", "⟧")
    lines = [f"data {pv.source}: format {pv.format}, tokenizer {pv.tokenizer}, template {pv.template}",
             f"under loss: {'green' if color else 'between ⟦ and ⟧'}; ↵ is a line break", ""]
    for v in pv.records:
        share = f"{100 * v.loss_tokens / v.tokens:.0f}%" if v.tokens else "-"
        what = f"record {v.index + 1}" + (f" {v.row}" if v.row else "")
        lines.append(f"── {what} ({v.where}): {v.tokens} tokens, {v.loss_tokens} under loss ({share})")
        lines.append("".join(f"{on}{_visible(p.text)}{off}" if p.loss else _visible(p.text) for p in v.pieces))
        lines.append("")
    if pv.format in ("preference", "prompts"):      # pairs and prompts are rows of their own: no window packs them
        return "\n".join(lines + [f"note: {n}" for n in pv.notes])
    joined = " + ".join(f"record {i + 1} [{take} of its tokens]" for i, _, take in pv.window)
    lines.append(f"the first window ({pv.seq_len + 1} tokens: data.seq_len + 1): {joined}"
                 + ("" if sum(t for *_, t in pv.window) >= pv.seq_len + 1 else
                    " (the shown records fill it only partly; the next records follow)"))
    lines.append("records join end to end, each ending with the EOS; the next window starts where this one ends")
    lines += [f"note: {n}" for n in pv.notes]
    return "\n".join(lines)


def cmd_data(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from shardconsole.settings import config as C
    if args.preview < 1:
        raise C.ConfigError(f"--preview: {args.preview} is below 1")
    resolved = settings.resolve(args.preset or DEFAULT_PRESET, settings.from_cli(args.overrides))
    from shardconsole.session import preflight
    spec = preflight.check_model(resolved, weights=False)
    # the launch's own data checks first: a bad path is blamed on where its value came from (--set
    # data.path, the preset file), as the launch says it, not on "preset"
    preflight.check_data(resolved)
    from shardconsole.settings import data_mix
    if data_mix.is_mix(resolved.cfg.data):
        return _mix(resolved.cfg, spec, args)
    from shardconsole.tryout.preview import preview
    pv = preview(resolved.cfg, spec, args.preview, rnd=args.random, seed=args.seed)
    if args.json:
        print(json.dumps(asdict(pv)))
    else:
        print(format_preview(pv, color=sys.stdout.isatty() and not args.plain))
    return 0


def _mix(cfg, spec, args) -> int:
    """Several sources: each one's share and epochs, then each one's records."""
    from shardconsole.tryout import mix_preview
    views = mix_preview.mix_views(cfg, spec, args.preview, rnd=args.random, seed=args.seed)
    if args.json:
        print(json.dumps({"sources": [asdict(v) for v in views]}))
        return 0
    color = sys.stdout.isatty() and not args.plain
    print("\n\n".join([mix_preview.header(views)] + [format_preview(v.preview, color) for v in views]))
    return 0
