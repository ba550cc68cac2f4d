"""The run folder's layout, in one place: the ranks, the launcher and the front ends read every name
from here. Standard library only (the ranks import it before torch).

    runs/<id>/
      preset.toml        the fully resolved settings (itself a preset); the ranks read only this
      metrics.jsonl      the stream: every step, memory, GPU and host sample, event, eval line
      metrics.node<N>.jsonl  on a run of several nodes, the lines of node N's ranks (N > 0): no two
                         hosts append to one file (NFS does not keep O_APPEND whole across hosts)
      metrics.host-<host>.jsonl  on a run of several nodes, the samples and notes of a front end there
      job.json           who started the run here: launcher pid/pgid, host, start time, argv
      job.<host>.<pid>.json  on a run of several nodes, one such file per node's agent (no node
                         overwrites another's): RunFolder.job is this host's newest
      stop_request.json  a stop asked through the folder (`shardconsole stop` of a multi-node or Slurm
                         run, Slurm's USR1): every node's ranks look for it at step boundaries
      origin.json        the preset it was made from, and "prepared" when --print-command / --slurm
                         only wrote it (the run starts elsewhere, or never)
      launcher.log       torchrun's / the deepspeed launcher's own output
      logs/rank<N>.log   each rank's stdout and stderr (C-level output too)
      checkpoints/       step_<N>/ folders (step_<N>.partial while being written)
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

PRESET_FILE = "preset.toml"
METRICS_FILE = "metrics.jsonl"
JOB_FILE = "job.json"
ORIGIN_FILE = "origin.json"
LAUNCHER_LOG = "launcher.log"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
STOP_REQUEST_FILE = "stop_request.json"


@dataclass(frozen=True)
class RunFolder:
    path: Path

    @property
    def preset(self) -> Path:
        return self.path / PRESET_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def job(self) -> Path:
        """The file that names the launcher to check here: this host's newest agent file on a run of
        several nodes, else job.json, else (a run whose agents are all elsewhere) the newest agent's."""
        agents = self.agents()
        here = [p for p in agents if agent_here(p)]
        if here:
            return here[0]
        if agents and not (self.path / JOB_FILE).is_file():
            return agents[0]
        return self.path / JOB_FILE

    def agents(self, session: str | None = None) -> list[Path]:
        """Every node's agent file (job.<host>.<pid>.json), newest first; with session, only that
        session's (a resumed run's earlier agents are history)."""
        found = []
        try:
            for p in self.path.glob("job.*.json"):
                try:
                    found.append((p.stat().st_mtime, p))
                except OSError:
                    continue
        except OSError:
            return []
        files = [p for _, p in sorted(found, reverse=True) if agent_host(p)]
        if session is None:
            return files
        return [p for p in files if read_json(p).get("run_id") == session]

    @property
    def origin(self) -> Path:
        return self.path / ORIGIN_FILE

    def read_origin(self) -> dict:
        """{"preset": name, "prepared": "print-command" | "slurm" | "", "created": time}; {} when absent
        or unreadable (a run folder of an older version)."""
        try:
            data = json.loads(self.origin.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def write_origin(self, preset: str, prepared: str = "") -> None:
        tmp = self.path / f".{ORIGIN_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"preset": preset, "prepared": prepared, "created": time.time()}))
        os.replace(tmp, self.origin)

    @property
    def launcher_log(self) -> Path:
        return self.path / LAUNCHER_LOG

    @property
    def logs(self) -> Path:
        return self.path / LOGS_DIR

    @property
    def stop_request(self) -> Path:
        return self.path / STOP_REQUEST_FILE

    def rank_log(self, rank: int) -> Path:
        return self.path / LOGS_DIR / f"rank{rank}.log"

    def checkpoints(self, configured: str = "") -> Path:
        """Where checkpoints go: train.checkpoint_dir when set, else checkpoints/ in the run folder."""
        return Path(configured).expanduser() if configured else self.path / CHECKPOINTS_DIR

    @property
    def run_id(self) -> str:
        return self.path.resolve().name


def _safe(host: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in host) or "host"


def agent_file_name(host: str, pid: int) -> str:
    """The agent file of a node's launcher (a run of several nodes): its host and pid in the name, so
    agents of one shared folder never overwrite each other (two agents on one host neither)."""
    return f"{Path(JOB_FILE).stem}.{_safe(host)}.{pid}.json"


def agent_host(path: Path) -> str:
    """The (file-safe) host in an agent file's name, '' when the name is not one."""
    middle = path.name[len(Path(JOB_FILE).stem) + 1:-len(".json")]
    host, _, pid = middle.rpartition(".")
    return host if path.name.startswith("job.") and host and pid.isdigit() else ""


def agent_here(path: Path) -> bool:
    """Whether an agent file names a launcher of this host."""
    return agent_host(path) == _safe(socket.gethostname())


def read_json(path: Path) -> dict:
    """A JSON object file's contents; {} when absent, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def metrics_file_of_node(node_rank: int) -> str:
    """The stream file a node's ranks append to: metrics.jsonl on node 0 (and on one machine)."""
    return METRICS_FILE if node_rank <= 0 else f"{Path(METRICS_FILE).stem}.node{node_rank}.jsonl"


def metrics_file_of_host(host: str) -> str:
    """The stream file a front end on `host` appends its samples and notes to, on a run of several
    nodes (each node's headless front end samples its own machine)."""
    return f"{Path(METRICS_FILE).stem}.host-{_safe(host)}.jsonl"


def node_metrics_files(main: Path) -> list[Path]:
    """The other stream files beside a metrics.jsonl: the nodes' ranks' by node rank, then the front
    ends' by host."""
    stem = Path(METRICS_FILE).stem
    if Path(main).name != METRICS_FILE:
        return []
    nodes, hosts = [], []
    try:
        for p in Path(main).parent.glob(f"{stem}.*.jsonl"):
            middle = p.name[len(stem) + 1:-len(".jsonl")]
            if middle.startswith("node") and middle[4:].isdigit():
                nodes.append((int(middle[4:]), p))
            elif middle.startswith("host-"):
                hosts.append((middle, p))
    except OSError:
        return []
    return [p for _, p in sorted(nodes)] + [p for _, p in sorted(hosts)]


def write_stop_request(folder: Path, session: str, who: str) -> Path:
    """Ask every node's ranks of `session` to save and stop: a file in the shared run folder, written
    whole (rename), because on NFS a signal reaches only this host's processes."""
    path = Path(folder) / STOP_REQUEST_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"session": session, "who": who, "t": time.time()}))
    os.replace(tmp, path)
    return path


def read_stop_request(folder: Path) -> dict | None:
    """The stop request in the folder, or None (none, or not readable yet)."""
    try:
        found = json.loads((Path(folder) / STOP_REQUEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
