"""Optimizers and how they step: low-bit AdamW, bf16 master updates with rounding, a step in the backward."""
