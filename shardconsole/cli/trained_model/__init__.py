"""The commands for what a run made: `shardconsole export-model` writes a checkpoint as a Hugging Face
model folder, `shardconsole chat` talks to one (a run's checkpoint is exported on the way, through
export-model itself). Tools, not front ends: torch and transformers are imported inside the commands.
"""
