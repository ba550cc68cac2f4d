"""The doctor's checks of this machine (GPUs, PCIe, P2P, the NCCL all-reduce, memlock, versions, DeepSpeed's
ops); `shardconsole doctor` (cli/doctor.py) prints them, machine/doctor_verdict.py keeps the P2P verdict.
"""
