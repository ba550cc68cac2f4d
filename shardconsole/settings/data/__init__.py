"""The data before launch: the records' shapes (pairs, prompts, KTO's labelled records), the scan of a data
file, the content hash the token cache and resume key on, and the prompt format an export records."""
