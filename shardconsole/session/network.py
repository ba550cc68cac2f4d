"""Before a multi-node launch: the two network mistakes that otherwise cost minutes and a wrong name
(issue 32 item 6), refused with the setting or variable that fixes them.

- gloo binds to the address the hostname resolves to. With Debian's `127.0.1.1 <hostname>` line that
  is loopback: the other nodes cannot reach it, and the run dies after the collective timeout, called
  a timeout. Every run needs gloo (the ranks' stop agreement; CPU ranks; offloaded gradients).
- torchrun's c10d rendezvous is hosted by the agent whose hostname (or one of its addresses) matches
  the endpoint. An endpoint given as this machine's IP that the hostname does not resolve to is
  hosted by nobody: every node waits, then all die.

Standard library and psutil only.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

from shardconsole.settings import config as C

GLOO_VAR, NCCL_VAR = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"


def _addresses_of(name: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return set()


def _loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return addr == "localhost"


def torchrun_hosts_here(host: str) -> bool:
    """Whether torchrun's agent on this machine would host a c10d rendezvous at `host` (torch's
    _matches_machine_hostname: loopback, the hostname itself, or an address the hostname resolves to)."""
    if _loopback(host):
        return True
    me = socket.gethostname()
    return host in (me, socket.getfqdn()) or bool(_addresses_of(host) & _addresses_of(me))


def _local_addresses() -> set[str]:
    try:
        import psutil
        return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    except Exception:      # no psutil answer: the check below cannot say, and says nothing
        return set()


def check_multi_node(cfg: C.RunConfig, endpoint_host: str, source: str,
                     env: Mapping[str, str] | None = None) -> None:
    """ConfigError (exit 2) before a launch of several nodes whose gloo would bind to loopback, or whose
    rendezvous this machine's address names but no agent would host. Loopback endpoints (every node on
    this machine, as in the tests) are left alone."""
    env = os.environ if env is None else env
    if cfg.parallel.nnodes < 2 or not endpoint_host or _loopback(endpoint_host):
        return
    me = socket.gethostname()
    mine = _addresses_of(me)
    if not env.get(GLOO_VAR) and mine and all(_loopback(a) for a in mine):
        gpu = cfg.parallel.device != "cpu"
        raise C.ConfigError(
            f"this host's name {me!r} resolves to {', '.join(sorted(mine))} (loopback): gloo would bind there and "
            f"the other nodes could not reach it; set {GLOO_VAR} to the cluster's interface (e.g. eth0)"
            + (f", and {NCCL_VAR} for NCCL" if gpu else "") + ", or map the hostname to its address in /etc/hosts",
            source=source, table="parallel", key="rdzv_endpoint")
    targets = _addresses_of(endpoint_host)
    if targets & _local_addresses() and not torchrun_hosts_here(endpoint_host):
        raise C.ConfigError(
            f"{endpoint_host} is this machine's address, but torchrun hosts the rendezvous only on the node whose "
            f"hostname matches it, and {me!r} resolves to {', '.join(sorted(mine)) or 'nothing'}: no node would "
            f"host it; give the hostname ({me}:PORT) as rdzv_endpoint, or map {me} to {endpoint_host} in /etc/hosts",
            source=source, table="parallel", key="rdzv_endpoint")
