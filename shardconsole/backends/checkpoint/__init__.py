"""Checkpoint folders (atomic step folders, manifests), the streaming writer, the end-of-run HF export."""
