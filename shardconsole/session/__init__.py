"""The run session: everything between "settings resolved" and "run ended" that has no UI in it.

Both front ends (headless.py and console/) are thin renderers of what lives here: preflight (the checks
before a launch), the watcher (stream, machine samples, rank logs, hang watch, rank pids), the outcome
(exit classification and its explanation; faults/: what it works out when the ranks cannot say) and the
one stop path. No torch, no textual.
"""
