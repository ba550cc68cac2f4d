"""Starting a run's processes: the argv, environment and sbatch script (command.py), the launcher in a
session of its own (job.py), the loopback-only rendezvous stores (loopback_torchrun.py, loopback_rank.py)
and which processes may be signalled (process_identity.py).
"""
