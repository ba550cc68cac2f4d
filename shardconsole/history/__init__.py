"""Every run kept: what a run folder says about its run (index), several runs side by side (compare,
textplot), the commands `runs` and `compare` (cli), the user's cache of ended runs' summaries (cache)
and the W&B export (wandb_export). The TensorBoard writer is tbevents.py, beside the stream, because
the session layer's watcher feeds it. No torch, no backends, no UI."""
