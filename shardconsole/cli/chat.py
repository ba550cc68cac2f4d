"""`shardconsole chat EXPORT_DIR | RUN [--step N] [--temperature T] [--top-p P] [--max-new-tokens N]
[--system TEXT] [--prompt TEXT]`: talk to a trained model in the terminal.

EXPORT_DIR is a folder export-model wrote; RUN a run folder or id, whose newest checkpoint (or --step N)
is exported on the way, through export-model itself, into a temporary folder. A multi-turn
conversation with the chat template the run trained with; tokens are printed as they are generated.
Ctrl-C stops a generation and returns to the prompt; Ctrl-C at the prompt or end of input (Ctrl-D)
ends the chat. `/reset` starts the conversation again. --prompt TEXT: one answer, then exit.
Temperature 0 (the default) is greedy decoding.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator, TextIO

from shardconsole.cli.errors import UsageError, run_folder


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="shardconsole chat", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", metavar="EXPORT_DIR|RUN", help="an exported model folder, or a run folder or id")
    ap.add_argument("--step", type=int, default=None, help="RUN: the checkpoint of this step (default: newest)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--system", default=None, help="a system message at the start of the conversation")
    ap.add_argument("--prompt", default=None, help="one user message: print the answer and exit")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: the GPU if the weights fit")
    return ap


@contextlib.contextmanager
def model_folder(target: str, step: int | None) -> Iterator[Path]:
    """The folder to load: the export itself, or a run's checkpoint exported through export-model."""
    path = Path(target).expanduser()
    if (path / "config.json").is_file():
        if step is not None:
            raise UsageError(f"--step: {path} is an exported model folder, not a run")
        yield path
        return
    run = run_folder(target)
    from shardconsole.cli.export_model import cmd_export_model
    with tempfile.TemporaryDirectory(prefix="shardconsole-chat-") as tmp:
        out = Path(tmp) / "model"
        argv = [str(run), "-o", str(out)] + (["--step", str(step)] if step is not None else [])
        with contextlib.redirect_stdout(sys.stderr):     # export-model's report is not the chat
            if cmd_export_model(argv) != 0:
                raise UsageError(f"{run}: its checkpoint could not be exported for the chat")
        yield out


def converse(model, sampling, lines: TextIO, out: TextIO, system: str | None) -> int:
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    while True:
        out.write("you> ")
        out.flush()
        try:
            line = lines.readline()
        except KeyboardInterrupt:
            out.write("\n")
            return 130
        if not line:
            out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            history = history[:1] if system else []
            out.write("(conversation reset)\n")
            continue
        history.append({"role": "user", "content": text})
        out.write("model> ")
        answer = _answer(model, history, sampling, out)
        history.append({"role": "assistant", "content": answer})


def _answer(model, history, sampling, out: TextIO) -> str:
    parts: list[str] = []
    stop = threading.Event()
    try:
        for piece in model.reply(history, sampling, stop):
            parts.append(piece)
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:       # Ctrl-C ends this generation, not the chat
        stop.set()
        out.write(" [stopped]")
    out.write("\n")
    out.flush()
    return "".join(parts)


def cmd_chat(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from shardconsole.tryout.chat import ChatModel, Sampling
    sampling = Sampling(args.temperature, args.top_p, args.max_new_tokens).check("--temperature/--top-p/--max-new-tokens")
    with model_folder(args.target, args.step) as folder:
        print(f"loading {folder} ...", file=sys.stderr)
        model = ChatModel(folder, args.device)
        print(f"chat with {args.target} on {model.device} (Ctrl-C stops an answer, Ctrl-D ends; /reset)",
              file=sys.stderr)
        if args.prompt is not None:
            history = ([{"role": "system", "content": args.system}] if args.system else [])
            _answer(model, history + [{"role": "user", "content": args.prompt}], sampling, sys.stdout)
            return 0
        return converse(model, sampling, sys.stdin, sys.stdout, args.system)


