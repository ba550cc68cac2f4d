"""torchrun for a one-node run, its rendezvous stores listening on 127.0.0.1 only.

torchrun's TCPStores (the c10d rendezvous store and the store the ranks meet in) listen on every
interface (`*:<port>`, IPv4 and IPv6) whatever address they are given: TCPStore takes no bind
address. It does take a listening socket (master_listen_fd), so every store this agent hosts is
handed one bound to loopback here; the agent is told (--local-addr) that the ranks reach it there.
Everything else is torchrun itself: `python -m shardconsole.launch.loopback_torchrun ARGS` = `torchrun ARGS`.
Only for one-node runs: a store on loopback cannot be reached from another node.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

import torch.distributed as dist

_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
         "master_listen_fd", "use_libuv")
_sockets: list[socket.socket] = []      # kept open for the agent's lifetime: the stores listen on them


class LoopbackTCPStore(dist.TCPStore):
    def __init__(self, *args, **kwargs) -> None:
        kw = dict(zip(_ARGS, args))
        kw.update(kwargs)
        if kw.get("is_master") and kw.get("master_listen_fd") is None:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", int(kw.get("port") or 0)))
            s.listen(4096)
            _sockets.append(s)
            kw["master_listen_fd"], kw["port"] = s.fileno(), s.getsockname()[1]
        super().__init__(**kw)


def _install() -> None:
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous
    dist.TCPStore = LoopbackTCPStore                       # elastic.utils.distributed, dynamic_rendezvous
    c10d_rendezvous_backend.TCPStore = LoopbackTCPStore    # imported by name there
    static_tcp_rendezvous.TCPStore = LoopbackTCPStore


def install_in_rank() -> None:
    """For ranks that host the env:// rendezvous store themselves (the deepspeed launcher's)."""
    import importlib
    # the module: `from torch.distributed import rendezvous` gives the function of that name
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    dist.TCPStore = LoopbackTCPStore
    # a module from import_module is a plain ModuleType to typeshed, which has no TCPStore to set
    rendezvous.TCPStore = LoopbackTCPStore                 # type: ignore[attr-defined]  # imported by name there


def main() -> None:
    _install()
    from torch.distributed.run import main as torchrun_main
    code = 0
    try:
        torchrun_main(sys.argv[1:])
    except Exception:       # noqa: BLE001 - ChildFailedError, SignalException: printed as Python would
        sys.excepthook(*sys.exc_info())
        code = 1
    # The agent's interpreter teardown (torch's modules, the stores' libuv loops) took 1.5-2.8 s after
    # the ranks had ended, measured on the 2-core box: every run's end waited on it. Nothing is left to
    # do by then (the ranks are gone, torchrun registers no atexit work), so the agent ends as the ranks
    # do (common.exit_rank), its logs and output flushed; the exit codes stay Python's own (0, 1).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
