"""What a rank measures and reports: step and memory lines, the offload view, the held-out loss, failures."""
