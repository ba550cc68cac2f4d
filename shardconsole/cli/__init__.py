"""The command line: main.py dispatches, one module per subcommand (run, presets, attach, stop, resume,
export-model, export/import as ds_json, plan, tune, runs/compare, doctor, settings). The top layer: it may
import every other package; nothing imports it.
"""
