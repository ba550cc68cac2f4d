"""The Textual console: pick a model and preset, edit the settings, launch and watch a run.

Nothing here imports torch, deepspeed or transformers (start-up stays well under a second and a broken
CUDA install cannot kill the UI); tests/test_console.py checks that in a fresh interpreter.
"""
