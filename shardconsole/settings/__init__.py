"""Settings: the tables (tables.py) and their values and rules, presets (preset_store.py), the one
resolve pipeline (resolve.py: preset + overrides -> settings), model shapes (models.py) and the data
checks before launch (data_check.py). No torch, no front end.
"""
