"""The engines (FSDP2, DeepSpeed) behind one contract, and the loop that drives them."""
