"""Start a real run and stop it at a random moment, many times; count processes left behind.

    python benchmarks/stop_cycles.py --cycles 50 --backend fsdp
    python benchmarks/stop_cycles.py --cycles 50 --backend deepspeed

Each cycle starts `tiny-cpu` through launch.Job (the path the front ends use), waits a random time
in [0, --max-wait] seconds (so stops land in start-up, model load, op builds, training and checkpoint
saves), stops it through session/stop.stop_run (SIGTERM, grace, SIGKILL) and checks that no process of the run is left.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from shardconsole.settings import config as C, preset_store  # noqa: E402
from shardconsole.launch.job import METRICS_FILE, PRESET_FILE, Job, _live  # noqa: E402
from shardconsole.session.stop import stop_run  # noqa: E402
from shardconsole.runlog.runstate import RunState  # noqa: E402
from shardconsole.runlog.stream import MetricsReader  # noqa: E402


def stream_state(run_dir: Path) -> RunState:
    state = RunState()
    for msg in MetricsReader(run_dir / METRICS_FILE).poll():
        state.apply(msg)
    return state


# The moments tests/test_stop_cycles.py stops at, each reached by what the stream and the process table
# show, not after a fixed time: the same moments on a fast machine and a loaded one (stratified random
# waits over 14 s stopped the slow CI machine's runs before training, and this box's twice at start-up).
# Each is "this or later", so a moment that passes between two looks still ends the wait.
MOMENTS = {
    "launch": lambda job, state, seen: True,                             # torchrun just spawned
    "ranks starting": lambda job, state, seen: bool(job.rank_pids()) or bool(state.hellos),  # imports, rendezvous
    "loading": lambda job, state, seen: bool({"building ops", "loading model", "training"} & seen),
    "training": lambda job, state, seen: state.last_step is not None,
    "checkpoint": lambda job, state, seen: "saving checkpoint" in seen,  # checkpoint_every=7
}
MOMENT_TIMEOUT_S = 240


def _until(moment: str):
    def wait(job: Job, run_dir: Path) -> None:
        reader, state, seen = MetricsReader(run_dir / METRICS_FILE), RunState(), set()
        deadline = time.monotonic() + MOMENT_TIMEOUT_S
        try:
            while True:
                for msg in reader.poll():
                    state.apply(msg)
                    seen.add(state.phase)
                if MOMENTS[moment](job, state, seen):
                    return
                if job.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the run ended or took {MOMENT_TIMEOUT_S} s before the moment {moment!r} "
                                         f"(phases seen: {sorted(seen)})")
                time.sleep(0.02)
        finally:
            reader.close()
    return wait


def cycle(backend: str, root: Path, i: int, wait: float | str, grace: float) -> dict:
    """One run stopped after `wait` seconds, or at the moment of MOMENTS that `wait` names."""
    cfg = preset_store.load("tiny-cpu", [f"parallel.backend={backend}", "train.steps=100000",
                                         "train.checkpoint_every=7", "train.log_every=1"])
    run_dir = root / f"{backend}-{i}"
    run_dir.mkdir(parents=True)
    C.save(cfg, run_dir / PRESET_FILE)
    job = Job.start(cfg, run_dir, run_dir.name)
    if isinstance(wait, str):
        _until(wait)(job, run_dir)
    else:
        time.sleep(wait)
    state = stream_state(run_dir)
    phase = state.phase if state.hellos else "not started"
    pids = tuple(state.rank_pids)
    # the one stop path (session/stop.py); a rank's stop save is waited for no longer than the grace
    report = stop_run(job, pids, who="stop_cycles", grace_s=grace, save_timeout_s=grace, check_gpus=False)
    time.sleep(0.2)
    left = _live(set(report.signalled) | set(pids))
    return {"cycle": i, "wait": wait if isinstance(wait, str) else round(wait, 2), "phase": phase, "stop_s": round(report.seconds, 2),
            "killed": report.killed, "left": left + report.left}


def run_cycles(backend: str, cycles: int, max_wait: float, grace: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="sc-stop-"))
    # Stratified: cycle i stops somewhere in the i-th slice of [0, max_wait], so even a few cycles
    # cover start-up, loading and training.
    return [cycle(backend, root, i, (i + rng.random()) * max_wait / cycles, grace) for i in range(cycles)]


def run_moments(backend: str, moments: list[str], grace: float) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="sc-stop-"))
    return [cycle(backend, root, i, moment, grace) for i, moment in enumerate(moments)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--backend", choices=["fsdp", "deepspeed"], default="fsdp")
    ap.add_argument("--max-wait", type=float, default=20.0)
    ap.add_argument("--grace", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = run_cycles(args.backend, args.cycles, args.max_wait, args.grace, args.seed)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    phases: dict[str, int] = {}
    for r in results:
        phases[r["phase"]] = phases.get(r["phase"], 0) + 1
    bad = [r for r in results if r["left"]]
    print(f"{args.backend}: {len(results)} cycles, stops by phase {phases}, "
          f"max stop {max(r['stop_s'] for r in results):.1f}s, SIGKILL needed {sum(r['killed'] for r in results)}, "
          f"cycles with processes left: {len(bad)}")
    for r in bad:
        print("  left:", r)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
