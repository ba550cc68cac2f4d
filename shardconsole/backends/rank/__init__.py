"""What a rank is and how it starts and ends: its identity and stream (common), test faults, the JIT build cache."""
