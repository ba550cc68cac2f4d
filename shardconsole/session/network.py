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
        return {str(info[4][0]) for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
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


def _endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


def who_hosts(endpoint: str) -> str:
    """What decides who hosts a c10d rendezvous, as a clause: what the endpoint's host resolves to and
    whether this node's torchrun would host it (its hostname and what that resolves to)."""
    host, _ = _endpoint(endpoint)
    targets, me = _addresses_of(host), socket.gethostname()
    named = f"{host} resolves to {', '.join(sorted(targets))}" if targets else f"{host} does not resolve here"
    mine = ", ".join(sorted(_addresses_of(me))) or "nothing"
    if torchrun_hosts_here(host):
        return f"{named}; this node ({me}, {mine}) hosts it"
    try:
        ipaddress.ip_address(host)
        node0 = f"the machine whose hostname resolves to {host}"
    except ValueError:
        node0 = f"the machine named {host}"
    return (f"{named}; this node ({me}, which resolves to {mine}) does not host it: torchrun hosts it on "
            f"{node0} only: is node 0's agent started, and does its hostname resolve to that address?")


def connect_error(endpoint: str, timeout_s: float = 2.0) -> str:
    """Why a TCP connect to the endpoint fails ('' when something accepts it)."""
    host, port = _endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except socket.timeout:
        return f"no answer within {timeout_s:.0f}s"
    except OSError as e:
        return e.strerror or str(e)


class RendezvousWatch:
    """While a multi-node run's ranks have not started (no hello line), the rendezvous is looked at every
    LOOK_EVERY_S from FIRST_LOOK_S on (torchrun's agent gives up after parallel.rdzv_connect_timeout_s
    when nobody hosts it, after rdzv_join_timeout_s when node 0 waits alone): one line when nothing
    answers at the endpoint, one when it answers but the other nodes have not come. A connect timeout
    shorter than 30 s moves the first look to a third of it, so that the line comes while the node waits."""

    FIRST_LOOK_S = 10.0
    LOOK_EVERY_S = 10.0
    ALONE_S = 60.0

    def __init__(self, endpoint: str, nnodes: int, started: float, connect_timeout_s: float = 60.0) -> None:
        self.endpoint, self.nnodes, self.started = endpoint, nnodes, started
        self._next = started + min(self.FIRST_LOOK_S, connect_timeout_s / 3)
        self._said: set[str] = set()

    def look(self, now: float) -> str:
        """A line to say now, or ''. Blocks for at most a connect's timeout."""
        if now < self._next or len(self._said) == 2:
            return ""
        self._next = now + self.LOOK_EVERY_S
        why = connect_error(self.endpoint)
        waited = now - self.started
        if why and "unhosted" not in self._said:
            self._said.add("unhosted")
            return (f"no rank has started after {waited:.0f}s and nothing answers at the rendezvous {self.endpoint} "
                    f"({why}): nobody hosts it; {who_hosts(self.endpoint)}")
        if not why and waited >= self.ALONE_S and "alone" not in self._said:
            self._said.add("alone")
            return (f"no rank has started after {waited:.0f}s: the rendezvous {self.endpoint} answers, so its host "
                    f"waits for the other node(s) of {self.nnodes}: start them with the same rdzv_endpoint")
        return ""
