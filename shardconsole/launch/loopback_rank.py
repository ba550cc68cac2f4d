"""A rank started by the deepspeed launcher on one node, the rendezvous store it may host on 127.0.0.1.

Under the deepspeed launcher the ranks meet through torch's env:// rendezvous, where rank 0 hosts a
TCPStore on MASTER_PORT, listening on every interface like torchrun's. The launcher's MASTER_ADDR
is 127.0.0.1 on one node, so the store is given a loopback socket (loopback_torchrun.LoopbackTCPStore)
and the rank then runs as `python -m shardconsole.backends` would.
"""

from __future__ import annotations

import runpy

from shardconsole.launch.loopback_torchrun import install_in_rank

if __name__ == "__main__":
    install_in_rank()
    runpy.run_module("shardconsole.backends", run_name="__main__", alter_sys=True)
