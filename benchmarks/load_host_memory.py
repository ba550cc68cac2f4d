"""The host RAM of loading a model folder, measured against the planner's loading moment (plan/loading.py).

Makes a Llama folder of ~166M parameters (hidden 1024, 8 layers, vocab 32000; weights saved in bf16 or
fp32, a small BPE tokenizer), runs real 2-rank CPU runs of it through the headless front end (tiny-cpu,
one step of synthetic data, no save) and reads every rank's /proc/<pid>/status every 10 ms while rank
0's phase (its stream's phase events) is "loading model" (DeepSpeed: until the rank unmaps the folder's
file, ENDS_AT_UNMAP): the largest VmRSS, RssAnon and RssFile, the same when the load began, and VmHWM
when it ended. Prints, per rank, in MiB:

  planned    the planner's figure for that rank at the load (plan/loading.Loading.rank_bytes), what it
             counts against the host budget
  measured   the rank's peak RssAnon + its RssFile when the load began (the libraries' pages): its RSS
             less the folder's pages, which are page cache (Loading.mapped_bytes, said apart)
  load adds  planned less the process's base (RANK_BASE_RSS_CPU), against RssAnon's growth over the load
  VmHWM, folder, mapped   the RSS peak (the folder's pages in it), the folder's pages seen (RssFile's
             growth), the planner's mapped_bytes for that rank

    python3 benchmarks/load_host_memory.py [--work DIR] [--cases fsdp-bf16,fsdp-fp32,...] [--json OUT]

CPU only (DS_ACCELERATOR=cpu); about a minute a case on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plan_calibrate import _Tail  # noqa: E402  (the calibration's reader of a growing metrics.jsonl)

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
             intermediate_size=2816, vocab_size=32000, max_position_embeddings=512)
COMMON = ["train.steps=1", "train.micro_batch=1", "train.grad_accum=1", "train.warmup_steps=0",
          "train.log_every=1", "train.save_final=none", "data.seq_len=32", "data.eval_fraction=0",
          "data.source=synthetic"]      # no tokenizer in the window: from "loading model" to "training" is the build
CASES = {     # name: (folder dtype, settings)
    "fsdp-bf16": ("bfloat16", ["parallel.backend=fsdp"]),
    "fsdp-fp32": ("float32", ["parallel.backend=fsdp"]),
    "fsdp-lora-bf16": ("bfloat16", ["parallel.backend=fsdp", "train.method=lora", "lora.rank=4"]),
    "zero2-bf16": ("bfloat16", ["parallel.backend=deepspeed", "deepspeed.stage=2"]),
    "zero3-bf16": ("bfloat16", ["parallel.backend=deepspeed", "deepspeed.stage=3"]),
}
# DeepSpeed's "loading model" phase goes on through deepspeed.initialize, which on CPU ranks allocates
# training's states: there a rank's window ends when it unmaps the folder's weights file (from_pretrained
# returns, ZeRO-3's load_pretrained_partitions closes its handles): the load is over.
ENDS_AT_UNMAP = ("zero2-bf16", "zero3-bf16")
MiB = 2**20


def make_folder(folder: Path, dtype: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from tests.hf_fixtures import train_tokenizer
    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save_pretrained(folder)
    cfg = LlamaConfig(**SHAPE, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    return folder


def _status(pid: int) -> dict[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out


def _maps(pid: int, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def measure(run_dir: Path, sets: list[str], env: dict, unmap: str = "") -> dict[int, dict[str, int]]:
    """Each rank's figures over rank 0's "loading model" phase."""
    argv = [sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(str(run_dir) + ".front.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    tail = _Tail(run_dir / "metrics.jsonl")
    pid_of: dict[int, int] = {}
    phase = "starting"
    got: dict[int, dict[str, int]] = {}
    while True:
        rc = proc.poll()
        for m in tail.read():
            if m.get("kind") == "hello" and m.get("pid") is not None:
                pid_of[int(m["rank"])] = int(m["pid"])
            elif m.get("kind") == "event" and m.get("name") == "phase" and m.get("rank") == 0:
                phase = str(m.get("detail"))      # rank 0 says the phases; the others are in step with it
        for rank, pid in pid_of.items():
            st = _status(pid)
            if st is None:
                continue
            g = got.setdefault(rank, {})
            if unmap and phase == "loading model" and "done" not in g:
                mapped = _maps(pid, unmap)
                if mapped and not g.get("seen"):
                    g["anon_at_map"] = st["RssAnon"]        # the model built (zero.Init), the read not begun
                g["seen"] = g.get("seen", 0) or int(mapped)
                if g["seen"] and not mapped:
                    g["done"] = 1
                    g["hwm_at_end"] = st["VmHWM"]
            if phase == "loading model" and "done" not in g:
                g.setdefault("file_at_start", st["RssFile"])
                g.setdefault("rss_at_start", st["VmRSS"])
                g.setdefault("anon_at_start", st["RssAnon"])
                for k in ("VmRSS", "RssAnon", "RssFile"):
                    g[k] = max(g.get(k, 0), st[k])
            elif "file_at_start" in g and "hwm_at_end" not in g and "done" not in g:
                g["hwm_at_end"] = st["VmHWM"]
        if rc is not None:
            break
        time.sleep(0.01)
    log.close()
    if rc != 0:
        raise SystemExit(f"{run_dir.name}: the run exited {rc}; see {run_dir}.front.log and {run_dir}/logs")
    return got


def planned(sets: list[str]):
    from shardconsole import plan as PL
    from shardconsole.settings import preset_store
    from shardconsole.settings.models import resolve
    cfg = preset_store.load("tiny-cpu", sets)
    return PL.estimate(cfg, resolve(cfg.model.name), PL.Hardware(0, 0, 0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="folder for the model folders and runs (default: a temporary one)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="load_host_memory."))
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", SHARDCONSOLE_RUNS_ROOT=str(work / "runs"),
               SHARDCONSOLE_CACHE_DIR=str(work / "cache"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'case':<15} {'rank':>4} | {'planned':>8} {'measured':>8} {'ratio':>5} | {'load adds':>9} {'measured':>8} "
          f"{'ratio':>5} | {'VmHWM':>6} {'folder':>6} {'mapped':>6}   (MiB)")
    for name in args.cases.split(","):
        dtype, extra = CASES[name]
        folder = make_folder(work / f"model-{dtype}", dtype)
        sets = [f"model.name={folder}", *COMMON, *extra]
        got = measure(work / "runs" / f"{name}-{time.strftime('%H%M%S')}", sets, env,
                      unmap=str(folder / "model.safetensors") if name in ENDS_AT_UNMAP else "")
        ld = planned(sets).loading
        base = next(v for k, v in ld.each.items() if k.startswith("process"))
        for rank in sorted(got):
            g = got[rank]
            counted = ld.rank_bytes(rank)
            # the rank's RSS less the folder's pages at its anonymous peak: the anonymous memory + the
            # libraries' mapped pages (RssFile when the load began)
            measured = g["RssAnon"] + g["file_at_start"]
            adds = g["RssAnon"] - g["anon_at_start"]
            reads = ld.who == "every rank" or rank == 0
            row = {"case": name, "rank": rank, "planned": counted, "measured": measured,
                   "planned_load_adds": counted - base, "measured_load_adds": adds,
                   "planned_mapped": ld.mapped_bytes if reads else 0,
                   "measured_folder_pages": g["RssFile"] - g["file_at_start"], "hwm_at_end": g.get("hwm_at_end"),
                   "peak_rss": g["VmRSS"], "peak_anon": g["RssAnon"], "rss_at_start": g["rss_at_start"],
                   "anon_at_start": g["anon_at_start"], "rss_file_at_start": g["file_at_start"],
                   "anon_at_map": g.get("anon_at_map")}
            rows.append(row)
            print(f"{name:<15} {rank:>4} | {counted / MiB:>8.0f} {measured / MiB:>8.0f} {counted / measured:>5.2f} | "
                  f"{(counted - base) / MiB:>9.0f} {adds / MiB:>8.0f} {(counted - base) / max(adds, 1):>5.2f} | "
                  f"{(g.get('hwm_at_end') or g['VmRSS']) / MiB:>6.0f} {row['measured_folder_pages'] / MiB:>6.0f} "
                  f"{row['planned_mapped'] / MiB:>6.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": SHAPE, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
