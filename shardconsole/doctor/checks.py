"""The doctor's checks of this machine: GPUs (CUDA and NVML indices, UUIDs, PCIe links), peer-to-peer and a
small NCCL all-reduce, memlock against the pinned memory a preset needs, versions and DeepSpeed's ops.
`shardconsole doctor` (cli/doctor.py) prints them; the P2P verdict is saved (machine/doctor_verdict.py)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shardconsole.machine.doctor_verdict import save_verdict

ALLREDUCE_TIMEOUT_S = 90.0


# ---------------------------------------------------------------------------------------------------
# The checks

def versions(probe) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    nv = getattr(probe, "_nvml", None) if not probe.unavailable else None
    out["driver"] = _text(_try(nv.nvmlSystemGetDriverVersion)) if nv else None
    cuda_drv = _try(nv.nvmlSystemGetCudaDriverVersion) if nv else None
    out["cuda_driver"] = f"{cuda_drv // 1000}.{cuda_drv % 1000 // 10}" if cuda_drv else None
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    nccl = _try(lambda: torch.cuda.nccl.version()) if torch.cuda.is_available() else None
    out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else (str(nccl) if nccl else None)
    try:
        from importlib.metadata import version
        out["deepspeed"] = version("deepspeed")
    except Exception:
        out["deepspeed"] = None
    return out


def gpus(probe) -> list[dict[str, Any]]:
    """Every card NVML lists, with the CUDA index torch gives it (matched by UUID)."""
    import torch
    from shardconsole.runlog.protocol import gpu_uuid_key
    cuda = {}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            u = _try(lambda i=i: str(torch.cuda.get_device_properties(i).uuid))
            if u:
                cuda[gpu_uuid_key(u)] = i
    out = []
    for c in probe.cards:
        out.append({"cuda_index": cuda.get(gpu_uuid_key(c.uuid)), "nvml_index": c.index, "uuid": c.uuid,
                    "name": c.name, "bus_id": c.bus_id, "pcie_gen": c.pcie_gen, "pcie_gen_max": c.pcie_gen_max,
                    "pcie_width": c.pcie_width, "pcie_width_max": c.pcie_width_max})
    return out


def p2p_pairs(probe, cards: list[dict]) -> list[dict[str, Any]]:
    import torch
    nv = probe._nvml
    visible = [c for c in cards if c["cuda_index"] is not None]
    handles = {c.index: h for c, h in zip(probe.cards, probe._handles)}
    out = []
    for a_i, a in enumerate(visible):
        for b in visible[a_i + 1:]:
            status = _try(nv.nvmlDeviceGetP2PStatus, handles[a["nvml_index"]], handles[b["nvml_index"]],
                          nv.NVML_P2P_CAPS_INDEX_READ)
            out.append({"cuda": [a["cuda_index"], b["cuda_index"]],
                        "torch_can_access_peer": bool(torch.cuda.can_device_access_peer(a["cuda_index"], b["cuda_index"])),
                        "nvml_p2p_read": None if status is None else status == nv.NVML_P2P_STATUS_OK})
    return out


def allreduce(world: int, p2p: bool, timeout_s: float = ALLREDUCE_TIMEOUT_S) -> dict[str, Any]:
    """W processes, one per GPU, one NCCL all-reduce of 64 MiB; killed when they hang."""
    env = dict(os.environ, NCCL_P2P_DISABLE="0" if p2p else "1")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "shardconsole.doctor.allreduce", "--rank", str(r),
                               "--world", str(world), "--port", str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, start_new_session=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        if any(p.poll() is None for p in procs):
            return {"ok": False, "hung": True, "error": f"no answer in {timeout_s:.0f} s (hung in NCCL)"}
        assert procs[0].stdout is not None          # stdout=subprocess.PIPE
        line = (procs[0].stdout.read() or "").strip().splitlines()
        return {"hung": False, **json.loads(line[-1])} if line else {"ok": False, "hung": False,
                                                                     "error": "rank 0 printed nothing"}
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
                p.wait()


def memlock(preset: str | None, overrides: list[str]) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    out: dict[str, Any] = {"soft_bytes": None if soft == resource.RLIM_INFINITY else soft,
                           "hard_bytes": None if hard == resource.RLIM_INFINITY else hard, "presets": []}
    from shardconsole import plan as PL
    from shardconsole.settings import preset_store, resolve as settings
    from shardconsole.session import preflight
    names = [preset] if preset else [p.name for p in preset_store.list_presets() if p.origin == "built-in"]
    hw = PL.detect_hardware()
    for name in names:
        try:
            resolved = settings.resolve(name, settings.from_cli(overrides))
            est = PL.estimate(resolved.cfg, preflight.check_model(resolved, weights=False), hw)
        except Exception as e:   # noqa: BLE001 - a preset the planner cannot read is listed, not fatal
            if preset:
                raise
            out["presets"].append({"preset": name, "error": str(e).splitlines()[0][:200]})
            continue
        pinned = sum(v for k, v in est.host_parts.items() if _pinned_part(k)) // max(1, est.ranks_per_node)
        if pinned or preset:
            out["presets"].append({"preset": name, "pinned_per_rank_bytes": pinned,
                                   "fits": soft == resource.RLIM_INFINITY or pinned <= soft})
    return out


# DeepSpeed's op builders a run may need: (op name, builder's `name`, what for). DeepSpeed itself is not
# imported (20 s on a loaded 2-core box): its install record and torch's JIT cache say what is built.
DS_OPS = (("CPUAdam", "cpu_adam", "optimizer offload"), ("FusedAdam", "fused_adam", "GPU Adam"),
          ("AsyncIO", "async_io", "NVMe offload"))


def _pinned_part(label: str) -> bool:
    """A planner host part that is page-locked: the planner says "pinned" in the part's name, and FSDP2's
    host arena (backends/offload/host_copy.py) pins everything it holds in place ("... in the host arena")."""
    return "pinned" in label or "host arena" in label


def deepspeed_ops() -> dict[str, Any]:
    """Each op a run may need: pre-built into the install, JIT-built in torch's extension cache, or not."""
    import ast
    import ctypes.util
    import importlib.util
    import shutil
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return {"error": "DeepSpeed is not installed"}
    installed: dict = {}
    record = Path(list(spec.submodule_search_locations)[0]) / "git_version_info_installed.py"
    try:
        for node in ast.parse(record.read_text()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "installed_ops":
                installed = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        pass
    import torch
    from shardconsole.backends.rank.jit_cache import extension_dir
    torch_cuda = torch.version.cuda
    can_jit = bool(shutil.which("ninja") or importlib.util.find_spec("ninja")) and bool(
        shutil.which(os.environ.get("CXX", "c++")))
    out: dict[str, Any] = {}
    for label, name, why in DS_OPS:
        so = extension_dir(name) / f"{name}.so"
        if installed.get(name):
            state = "pre-built"
        elif so.exists():
            state = "JIT-built (cached)"
        elif name == "fused_adam" and not torch_cuda:
            state = "not for this machine (a CUDA build of torch runs it)"
        elif name == "async_io" and not ctypes.util.find_library("aio"):
            state = "cannot build here: libaio is missing (apt install libaio-dev)"
        elif can_jit:
            state = "not built: compiles at the first run that needs it (a few minutes)"
        else:
            state = "cannot build here: needs ninja and a C++ compiler"
        out[label] = {"for": why, "state": state, "cache": str(so.parent)}
    return out


def collect(preset: str | None, overrides: list[str], run_allreduce: bool) -> dict[str, Any]:
    from shardconsole.machine.probes import GpuProbe
    probe = GpuProbe()
    report: dict[str, Any] = {"host": socket.gethostname(), "nvml": probe.unavailable or "ok", "problems": []}
    problems = report["problems"]
    report["memlock"] = memlock(preset, overrides)    # first: a bad --preset is refused before GPU work
    report["versions"] = versions(probe)
    cards = report["gpus"] = gpus(probe) if not probe.unavailable else []
    for c in cards:
        if c["pcie_width"] and c["pcie_width_max"] and c["pcie_width"] < c["pcie_width_max"]:
            problems.append(f"GPU{c['nvml_index']} runs its PCIe link at x{c['pcie_width']} of x{c['pcie_width_max']} "
                            "(idle cards may drop the width to save power: check it under load)")
    report["p2p"] = p2p_pairs(probe, cards) if len(cards) > 1 else []
    visible = [c for c in cards if c["cuda_index"] is not None]
    report["allreduce"] = {}
    if run_allreduce and len(visible) > 1:
        on, off = allreduce(len(visible), True), allreduce(len(visible), False)
        report["allreduce"] = {"p2p": on, "no_p2p": off}
        broken = not on.get("ok") and bool(off.get("ok"))
        detail = (f"all-reduce over {len(visible)} GPUs with P2P: {on.get('error') or 'ok'}; "
                  f"without: {off.get('error') or 'ok'}")
        report["p2p_verdict_file"] = str(save_verdict([c["uuid"] for c in visible], broken, detail))
        if broken:
            problems.append(f"NCCL with peer-to-peer fails and without it works ({detail}): launches on this "
                            "machine will set NCCL_P2P_DISABLE=1 themselves")
        elif not on.get("ok"):
            problems.append(f"NCCL all-reduce fails with and without P2P ({detail})")
    mem = report["memlock"]
    # Runs pin host memory only with a GPU (CPU ranks allocate plainly): without one the comparison is
    # for a GPU box with this limit, said in the report, not a problem of this machine.
    mem["applies"] = bool(cards)
    for p in mem["presets"]:
        if p.get("fits") is False and cards:
            problems.append(f"memlock limit {_gib(mem['soft_bytes'])} is below the {_gib(p['pinned_per_rank_bytes'])} "
                            f"a rank of {p['preset']} pins: raise `ulimit -l` (docker: --ulimit memlock=-1) or set "
                            "fsdp.pin_memory / deepspeed.pin_memory = false (slower copies)")
    report["deepspeed_ops"] = deepspeed_ops()
    return report


def format_report(r: dict[str, Any]) -> str:
    v = r["versions"]
    lines = [f"shardconsole doctor on {r['host']}", "",
             "versions: " + ", ".join(f"{k} {v[k] or 'n/a'}" for k in
                                      ("driver", "cuda_driver", "torch", "torch_cuda", "nccl", "deepspeed", "python"))]
    lines.append("")
    if not r["gpus"]:
        lines.append(f"GPUs: none ({r['nvml']}): no GPU checks (PCIe, P2P, all-reduce) on this machine")
    else:
        lines.append("GPUs (CUDA index as torch numbers them, NVML index as nvidia-smi does):")
        for c in r["gpus"]:
            cuda = "-" if c["cuda_index"] is None else c["cuda_index"]
            lines.append(f"  cuda {cuda}  nvml {c['nvml_index']}  {c['uuid']}  {c['name']}  {c['bus_id']}  "
                         f"PCIe gen {c['pcie_gen'] or '?'}/{c['pcie_gen_max'] or '?'} "
                         f"x{c['pcie_width'] or '?'}/x{c['pcie_width_max'] or '?'} (now/max)")
    for p in r["p2p"]:
        lines.append(f"  P2P cuda {p['cuda'][0]} <-> {p['cuda'][1]}: torch can_device_access_peer "
                     f"{p['torch_can_access_peer']}, NVML read {p['nvml_p2p_read']}")
    for name, res in r["allreduce"].items():
        what = (f"{res.get('busbw_gbps', 0):.1f} GB/s bus bandwidth" if res.get("ok") else res.get("error", "failed"))
        lines.append(f"  all-reduce 64 MiB, {'with' if name == 'p2p' else 'without'} P2P: {what}")
    if len(r["gpus"]) < 2 and r["gpus"]:
        lines.append("  P2P and the all-reduce need two GPUs: one here")
    mem = r["memlock"]
    lines += ["", f"memlock (ulimit -l): {_gib(mem['soft_bytes'])} (hard {_gib(mem['hard_bytes'])})"
              + ("" if mem.get("applies", True) else "; no GPU here, so runs here pin nothing: the presets below "
                 "are judged for a GPU box with this limit")]
    for p in mem["presets"]:
        if "error" in p:
            lines.append(f"  {p['preset']}: not planned ({p['error']})")
        else:
            lines.append(f"  {p['preset']}: pins {_gib(p['pinned_per_rank_bytes'])} a rank (planner): "
                         + ("fits" if p["fits"] else "OVER the limit"))
    ops = r["deepspeed_ops"]
    lines += ["", "DeepSpeed ops:"]
    if "error" in ops:
        lines.append(f"  cannot tell: {ops['error']}")
    for name, o in ops.items():
        if isinstance(o, dict):
            lines.append(f"  {name} ({o['for']}): {o['state']}")
    lines += ["", "problems: none" if not r["problems"] else "problems:"]
    lines += [f"  - {p}" for p in r["problems"]]
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _text(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else (None if v is None else str(v))


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
