"""Issue 19 on the GPU machine, in one call: the doctor, the NVML view of the card with its UUID matched to
torch's, whether pinning fails under a low memlock limit, and the offload view on real offloaded runs
(FSDP2 3090-offload with the view off, then on: its cost; DeepSpeed ZeRO-3 with optimizer offload: the
view on the other backend).

    python3 benchmarks/offload_view_cost.py --out DIR [--steps 30] [--ds-timeout 90]

Runs start as a user starts them (`shardconsole --preset ... --headless`); numbers are read from each
run's metrics.jsonl. Prints a short table last; everything else goes under DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PIN_PROBE = r"""
import torch, json
out = {}
try:
    t = torch.empty(64 << 20).pin_memory()          # 256 MiB through torch's CachingHostAllocator
    out["pin_memory"] = "ok" if t.is_pinned() else "not pinned"
except Exception as e:
    out["pin_memory"] = f"{type(e).__name__}: {e}"[:200]
try:
    from torch.cuda import _pin_memory_utils
    u = torch.empty(64 << 20)
    _pin_memory_utils.pin_memory(u.data_ptr(), u.numel() * u.element_size())   # cudaHostRegister (offload.py)
    out["host_register"] = "ok" if u.is_pinned() else "not pinned"
except Exception as e:
    out["host_register"] = f"{type(e).__name__}: {e}"[:200]
print(json.dumps(out))
"""

UUID_PROBE = r"""
import json, torch
from shardconsole.machine.probes import GpuProbe
from shardconsole.runlog.protocol import gpu_uuid_key, encode
p = GpuProbe()
t = str(torch.cuda.get_device_properties(0).uuid)
print(json.dumps({"torch_uuid": t, "nvml": [c.uuid for c in p.cards],
                  "matched": [c.index for c in p.cards if gpu_uuid_key(c.uuid) == gpu_uuid_key(t)],
                  "sample": json.loads(encode(p.sample()[0])) if p.count else None}))
"""


def sh(cmd: list[str] | str, out: Path, name: str, timeout: float, env: dict | None = None) -> tuple[int, str]:
    t0 = time.time()
    try:
        res = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **(env or {})})
        rc, text = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    (out / f"{name}.txt").write_text(f"$ {cmd}\nrc={rc} in {time.time() - t0:.1f}s\n{text}")
    return rc, text


def run(out: Path, name: str, preset: str, sets: list[str], env: dict, timeout: float) -> dict:
    run_dir = Path("/tmp/g19") / name
    args = [sys.executable, "-m", "shardconsole", "--preset", preset, "--headless", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    rc, text = sh(args, out, name, timeout, env)
    msgs = []
    try:
        msgs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        pass
    (out / f"{name}.metrics.jsonl").write_text("\n".join(json.dumps(m) for m in msgs))
    steps = [m for m in msgs if m.get("kind") == "step"]
    offload = [m for m in msgs if m.get("kind") == "offload" and m.get("rank") == 0]
    later = [s["step_s"] for s in steps[1:]]      # the first log line holds warm-up
    return {"name": name, "rc": rc, "steps": len(steps), "step_s": [round(s["step_s"], 4) for s in steps],
            "median_step_s": statistics.median(later) if later else None,
            "offload_last": offload[-1] if offload else None,
            "offload_lines": [x for x in text.splitlines() if x.startswith("offload")][-3:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--ds-timeout", type=float, default=90)
    ap.add_argument("--fsdp-preset", default="3090-offload")
    ap.add_argument("--ds-preset", default="4090x2-zero3")
    ap.add_argument("--extra", action="append", default=[], help="more --set for every run (a CPU smoke test)")
    ap.add_argument("--no-ds", action="store_true", help="skip the DeepSpeed run (its CPUAdam JIT build alone "
                                                          "takes 40-60 s on a fresh machine)")
    a = ap.parse_args()
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    rc, text = sh([sys.executable, "-m", "shardconsole", "doctor", "--json"], out, "doctor", 150)
    result["doctor_rc"] = rc
    try:
        from shardconsole.doctor.checks import format_report
        doc = json.loads(text[text.index("{"):text.rindex("}") + 1])
        (out / "doctor.json").write_text(json.dumps(doc, indent=1))
        print(format_report(doc), flush=True)
    except (ValueError, KeyError) as e:
        print(f"doctor: rc {rc}, unreadable JSON ({e}): {text[-2000:]}", flush=True)
    rc, text = sh([sys.executable, "-c", UUID_PROBE], out, "uuid", 60)
    result["uuid"] = text.strip().splitlines()[-1] if text.strip() else ""
    probe = out / "pin_probe.py"
    probe.write_text(PIN_PROBE)
    for limit in ("64", "unlimited_or_current"):
        cmd = ("ulimit -S -l 64; " if limit == "64" else "") + f"ulimit -l; {sys.executable} {probe}"
        rc, text = sh(["bash", "-c", cmd], out, f"pin_{limit}", 60)
        result[f"pin_memlock_{limit}"] = text.strip().splitlines()[-1] if text.strip() else f"rc {rc}"
    sets = [f"train.steps={a.steps}", "train.log_every=5", "train.save_final=false", *a.extra]
    print("uuid:", result["uuid"][:600], "\npin:", result["pin_memlock_64"], result["pin_memlock_unlimited_or_current"],
          flush=True)
    result["fsdp_off"] = run(out, "fsdp_view_off", a.fsdp_preset, sets, {"SHARDCONSOLE_OFFLOAD_VIEW": "off"}, 100)
    print("fsdp_off:", json.dumps(result["fsdp_off"])[:800], flush=True)
    result["fsdp_on"] = run(out, "fsdp_view_on", a.fsdp_preset, sets, {}, 100)
    print("fsdp_on:", json.dumps(result["fsdp_on"])[:1500], flush=True)
    (out / "offload_view_cost.json").write_text(json.dumps(result, indent=1))
    result["ds_on"] = {"name": "ds_view_on", "rc": None, "steps": 0, "step_s": [], "median_step_s": None,
                       "offload_lines": ["skipped (--no-ds)"]} if a.no_ds else run(out, "ds_view_on", a.ds_preset,
                          ["parallel.nproc_per_node=1", "train.steps=8", "train.log_every=2", "train.save_final=false",
                           *a.extra],
                          {}, a.ds_timeout)
    (out / "offload_view_cost.json").write_text(json.dumps(result, indent=1))
    off, on = result["fsdp_off"]["median_step_s"], result["fsdp_on"]["median_step_s"]
    print("\n=== issue 19 on the GPU ===")
    print("uuid:", result["uuid"][:400])
    print("pin under memlock 64 KiB:", result["pin_memlock_64"], "| as found:", result["pin_memlock_unlimited_or_current"])
    for k in ("fsdp_off", "fsdp_on", "ds_on"):
        r = result[k]
        print(f"{k}: rc {r['rc']}, {r['steps']} step lines, step_s {r['step_s']}, median {r['median_step_s']}")
        for line in r["offload_lines"]:
            print("   ", line[:300])
    if off and on:
        print(f"view cost, A/B: {(on - off) / off * 100:+.2f}% of step time (median of log lines after the first; "
              f"run-to-run noise of the same setting is of this order)")
    last = result["fsdp_on"].get("offload_last") or {}
    if last.get("view_s") is not None and last.get("step_s"):
        print(f"view cost, measured inside the ranks: {last['view_s'] * 1e3:.2f} ms a step = "
              f"{last['view_s'] / last['step_s'] * 100:.3f}% of {last['step_s']:.3f} s (host time in the view's code)")


if __name__ == "__main__":
    main()
