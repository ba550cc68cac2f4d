"""`shardconsole chat EXPORT_DIR | RUN [--step N] [--temperature T] [--top-p P] [--max-new-tokens N]
[--system TEXT] [--prompt TEXT] [--base [FOLDER]] [--raw]`: talk to a trained model in the terminal.

EXPORT_DIR is a folder export-model wrote; RUN a run folder or id, whose newest checkpoint (or --step N)
is exported on the way, through export-model itself, into a temporary folder. A multi-turn
conversation with the chat template the run trained with; tokens are printed as they are generated.
Ctrl-C stops a generation and returns to the prompt; Ctrl-C at the prompt or end of input (Ctrl-D)
ends the chat. `/reset` starts the conversation again. --prompt TEXT: one answer, then exit.
Temperature 0 (the default) is greedy decoding. --base: the run's base model (the folder it started
from, or FOLDER) answers each message too, with the same prompt, after the trained model. --raw: no chat
template, each message is text for the model to continue (a run on plain text exports no template). A
prompt longer than the model's positions is refused in one line; an answer ends where they end, said.
--serve: the console's chat process (tryout/chat_serve.py), JSON lines on stdin and stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator, TextIO

from shardconsole.cli.errors import UsageError, run_folder
from shardconsole.settings import config as C


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="shardconsole chat", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", metavar="EXPORT_DIR|RUN",
                    help="an exported model folder (export-model's, --adapter's too), or a run folder or id")
    ap.add_argument("--step", type=int, default=None, help="RUN: the checkpoint of this step (default: newest)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--system", default=None, help="a system message at the start of the conversation")
    ap.add_argument("--prompt", default=None, help="one user message: print the answer and exit")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: the GPU if the weights fit")
    ap.add_argument("--base", nargs="?", const="", default=None, metavar="FOLDER",
                    help="the base model answers too (default: the folder the run started from)")
    ap.add_argument("--raw", action="store_true",
                    help="no chat template: each message is plain text for the model to continue (a run on plain text)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    return ap


@contextlib.contextmanager
def model_folder(target: str, step: int | None) -> Iterator[Path]:
    """The folder to load: the export itself, or a run's checkpoint exported through export-model."""
    from shardconsole.tryout.chat import is_model_folder
    path = Path(target).expanduser()
    if is_model_folder(path):
        if step is not None:
            raise UsageError(f"--step: {path} is an exported model folder, not a run")
        yield path
        return
    try:
        run = run_folder(target)
    except UsageError as e:
        # neither kind: the run-folder error alone reads as if chat took only runs
        raise UsageError(f"{e}; nor a model folder (config.json and weights): chat takes a run folder or id, "
                         f"or a model folder such as one `shardconsole export-model` writes") from None
    from shardconsole.tryout.base import no_tokenizer
    if why := no_tokenizer(run):
        raise UsageError(why)
    from shardconsole.cli.trained_model.export_model import cmd_export_model
    with tempfile.TemporaryDirectory(prefix="shardconsole-chat-") as tmp:
        out = Path(tmp) / "model"
        argv = [str(run), "-o", str(out)] + (["--step", str(step)] if step is not None else [])
        with contextlib.redirect_stdout(sys.stderr):     # export-model's report is not the chat
            if cmd_export_model(argv) != 0:
                raise UsageError(f"{run}: its checkpoint could not be exported for the chat")
        yield out


def base_of(target: str, choice: str | None):
    """The base beside the run's model: None (not asked), or tryout.base.Base (a folder, or why none)."""
    from shardconsole.tryout import base as B
    if choice is None:
        return None
    if choice:
        return B.of_folder(Path(choice).expanduser())
    from shardconsole.tryout.chat import adapter_base, is_model_folder
    path = Path(target).expanduser()
    if not is_model_folder(path):
        return B.of_run(run_folder(target))
    try:
        on = adapter_base(path)
    except C.ConfigError as e:
        return B.Base(None, str(e))
    return B.Base(on) if on is not None else B.of_export(path)


def converse(models, sampling, lines: TextIO, out: TextIO, system: str | None) -> int:
    """models: (label, model) pairs, the run's first. The run's answers make the conversation; the others
    (the base) answer each message given the very same prompt, so they show what training changed."""
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
        answers = []
        try:
            for label, model in models:
                out.write(f"{label}> ")
                answers.append(_answer(model, history, sampling, out))
        except C.ConfigError as e:      # a prompt longer than the model reads: said, the chat goes on without it
            out.write("\n")
            print(f"shardconsole: {e}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": answers[0]})


# What an answer without a word says (the console's chat says the same, console/chat_state.py): the model's
# first token ended its turn (a small base, or a fine-tune whose data taught it to stop).
EMPTY_ANSWER = ("(nothing: the model ended its turn at once, without a word; try --temperature 0.7, "
                "another message, or more training)")


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
    else:
        if not "".join(parts).strip():      # an empty line reads as a chat that failed or hangs
            out.write(EMPTY_ANSWER)
        elif model.cut:
            out.write(f" [cut: the model's {model.positions:,} positions end here]")
    out.write("\n")
    out.flush()
    return "".join(parts)


def _serve(args) -> int:
    """The console's chat process: every outcome, a failed export included, is a wire line, not stderr."""
    from shardconsole.settings import config as C
    from shardconsole.tryout import chat_wire as W
    from shardconsole.tryout.chat_serve import serve
    say = lambda msg: (sys.stdout.write(W.encode(msg)), sys.stdout.flush())    # noqa: E731
    from shardconsole.tryout.chat import is_model_folder
    exported = not is_model_folder(Path(args.target).expanduser())
    try:
        base = base_of(args.target, args.base if args.base is not None else "")
        name = Path(args.target).name
        if exported:
            which = f"step {args.step}" if args.step is not None else "the newest checkpoint"
            say(W.Loading(W.RUN, f"exporting {which} of {args.target} (export-model)"))
            name = f"{name}, {which}"
        with model_folder(args.target, args.step) as folder:
            return serve(folder, base, args.device, sys.stdin, sys.stdout, name)
    except (UsageError, C.ConfigError) as e:
        say(W.Unavailable(W.RUN, str(e)))
        return 2
    except Exception as e:      # export-model's refusals (ExportError) and any other: the console's one line
        say(W.Unavailable(W.RUN, str(e) or type(e).__name__))
        return 2


def _parse(argv: list[str]) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    # float() reads "nan" and "inf" (and 1e400 as inf): nan passed Sampling's range checks, every comparison
    # with it being false, and failed inside torch's sampling with a traceback
    for flag, value in (("--temperature", args.temperature), ("--top-p", args.top_p)):
        if not math.isfinite(value):
            example = "0.7" if flag == "--temperature" else "0.9"
            raise UsageError(f"{flag}: {value} is not a number; give e.g. {example}")
    return args


def cmd_chat(argv: list[str]) -> int:
    args = _parse(argv)
    if args.serve:
        return _serve(args)
    from shardconsole.tryout.chat import RAW_WORDS, ChatModel, Sampling
    sampling = Sampling(args.temperature, args.top_p, args.max_new_tokens).check("--temperature/--top-p/--max-new-tokens")
    base = base_of(args.target, args.base)
    if base is not None and base.folder is None:
        raise UsageError(f"--base: {base.why}")
    from shardconsole.tryout.chat import adapter_base
    with model_folder(args.target, args.step) as folder:
        adapter_base(folder)        # an adapter folder whose base is gone: one line, before anything loads
        print(f"loading {folder} ...", file=sys.stderr)
        models = [("model", ChatModel(folder, args.device, raw=args.raw))]
        if models[0][1].trained_raw and not args.raw:
            print(f"chat: prompt format {RAW_WORDS}", file=sys.stderr)
        if base is not None:
            print(f"loading the base {base.folder} ...", file=sys.stderr)
            models.append(("base", ChatModel(base.folder, args.device, tokenizer_from=folder, raw=args.raw)))
        print(f"chat with {args.target} on {models[0][1].device} (Ctrl-C stops an answer, Ctrl-D ends; /reset)",
              file=sys.stderr)
        if args.prompt is not None:
            history = ([{"role": "system", "content": args.system}] if args.system else [])
            history.append({"role": "user", "content": args.prompt})
            for label, model in models:
                if base is not None:
                    sys.stdout.write(f"{label}> ")
                _answer(model, history, sampling, sys.stdout)
            return 0
        return converse(models, sampling, sys.stdin, sys.stdout, args.system)
