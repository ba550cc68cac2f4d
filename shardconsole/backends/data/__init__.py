"""Training and eval batches: the records of a data file (corpus), its token cache, packed windows (batches)."""
