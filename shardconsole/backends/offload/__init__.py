"""FSDP2's host side under CPU offload: the compute copy, the pinned host arena, the overlapped host step."""
