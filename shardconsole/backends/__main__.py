"""Entry point of a rank: read the run's preset.toml, train with the chosen backend, report, exit."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m shardconsole.backends")
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = ap.parse_args()
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))

    from shardconsole.backends.rank import common  # import torch: after argument parsing
    from shardconsole.backends.observe import failures
    r = None
    code = 0
    t0 = time.time()
    try:
        r = common.start(args.run_dir, args.run_id)
        from shardconsole.backends.engine import loop, select
        loop.run(r, select.engine(r))
        r.phase("finished")
        common.shutdown(r)
        from shardconsole.runlog.protocol import Finished
        if r.rank == 0:
            done = Finished(run=r.run_id, rank=0, steps=r.step, elapsed_s=time.time() - t0,
                            tokens=r.step * r.cfg.tokens_per_step if r.progress.tokens is None
                            else r.progress.tokens)
            r.emit(done)
            if r.writer.path is not None:
                # also in the rank's log: a metrics.jsonl deleted later still leaves the end said
                # (session/faults/stream_gone.py); with the stream off, emit printed it there already
                from shardconsole.runlog.protocol import encode
                print(encode(done), flush=True)
    except BaseException as exc:   # noqa: BLE001 - every failure is reported, then the rank ends
        if isinstance(exc, SystemExit) and not exc.code:
            code = 0
        else:
            failures.report_failure(r, exc, args.run_dir, args.run_id)    # once: the engine's may have
            code = 1
    if r is not None:
        r.writer.close()      # after its last line (one write() a line: nothing is left to flush)
    common.exit_rank(code)


if __name__ == "__main__":
    main()
