"""shardconsole: a terminal console for PyTorch FSDP2 and DeepSpeed ZeRO training."""

__version__ = "0.1.0"
