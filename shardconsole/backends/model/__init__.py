"""The model the ranks train: building it (modeling), LoRA adapters, QLoRA's 4-bit base."""
