"""A run's checkpoint read back as model weights (checkpoint.py: DCP or DeepSpeed, one process, no
process group) and written as a Hugging Face folder (hf_folder.py); `shardconsole export-model` is
cli/trained_model/export_model.py.
"""
