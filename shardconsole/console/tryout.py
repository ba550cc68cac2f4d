"""The data preview in the console: `shardconsole data --preview --json` run in a child process (the
console imports no torch, datasets or transformers; the preview is the ranks' own tokenizing code), its
answer drawn with the tokens under loss in colour. Called from a thread worker: it blocks."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.text import Text

from shardconsole.settings import config as C

PREVIEW_RECORDS = 3
PREVIEW_TIMEOUT_S = 180.0


def preview(cfg: C.RunConfig, records: int = PREVIEW_RECORDS) -> tuple[str, Text]:
    """(title, body) of the first records as the model will see them, or of why there are none."""
    with tempfile.TemporaryDirectory(prefix="shardconsole-preview-") as tmp:
        preset = Path(tmp) / "preview.toml"
        C.save(cfg, preset)
        try:
            out = subprocess.run([sys.executable, "-m", "shardconsole", "data", "--preview", str(records), "--json",
                                  "--preset", str(preset)], capture_output=True, text=True, timeout=PREVIEW_TIMEOUT_S,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return "No preview", Text(f"the preview took longer than {PREVIEW_TIMEOUT_S:.0f}s")
    if out.returncode != 0:
        lines = [ln for ln in out.stderr.strip().splitlines() if ln.startswith("shardconsole")]
        return "No preview", Text((lines[-1] if lines else out.stderr.strip()[-400:]).removeprefix("shardconsole: "))
    return _title(json.loads(out.stdout)), _body(json.loads(out.stdout))


def _title(pv: dict) -> str:
    return f"{pv['source']}: {len(pv['records'])} record(s), format {pv['format']}"


def _body(pv: dict) -> Text:
    t = Text()
    t.append(f"tokenizer {pv['tokenizer']}, template {pv['template']}; ", style="dim")
    t.append("under loss", style="bold green")
    t.append(", the rest not; ↵ is a line break\n\n", style="dim")
    for r in pv["records"]:
        t.append(f"record {r['index'] + 1} ({r['where']}): {r['tokens']} tokens, {r['loss_tokens']} under loss\n",
                 style="bold")
        for p in r["pieces"]:
            t.append(p["text"].replace("\n", "↵\n"), style="bold green" if p["loss"] else "")
        t.append("\n\n")
    window = " + ".join(f"record {i + 1} [{n} tokens]" for i, _, n in pv["window"])
    t.append(f"first window ({pv['seq_len'] + 1} tokens): {window}\n", style="dim")
    for note in pv["notes"]:
        t.append(f"note: {note}\n", style="yellow")
    return t
