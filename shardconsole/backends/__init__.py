"""Code that runs inside each rank. Start with `python -m shardconsole.backends --run-dir DIR --run-id ID`
under torchrun or the deepspeed launcher; the front end builds that command (shardconsole.launch.job)."""
