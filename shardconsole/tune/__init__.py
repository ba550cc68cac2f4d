"""`shardconsole tune` (issue 16): the planner lists the settings that fit, short real probe runs measure
them, the fastest that stayed under the caps is saved as a user preset.

  engine.py   the loop: options (plan/search.py), probes best first, re-ranked after each, the winner
  probe.py    one probe: a real launch through session/rundir, launch.Job and session/watcher
  report.py   the table's cells (CLI and console) and the preset file with the figures in its header
  cli.py      the command

A front end: no torch, no backends (pyproject's import-linter contract)."""
