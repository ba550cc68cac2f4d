"""What this machine is and says, with no UI: NVML and psutil samples (probes.py), GPU peak rates
(hardware.py), the torch version check, the offload view's and flight recorder's readings and the
doctor's saved verdict. Clients: the front ends, the planner, the launcher.
"""
