"""The command line: main.py dispatches, one module per subcommand (run, presets, attach, stop, resume,
data, export/import as ds_json, plan, tune, runs/compare, doctor, settings; trained_model/: export-model
and chat, the commands for what a run made). The top layer: it may import every other package; nothing
imports it.
"""

import os as _os
import signal as _signal
import sys as _sys

# `attach` that loses its terminal before cli.main installs its handlers (the imports take a few tenths of
# a second) ends as a detach, exit 8, like a later SIGHUP: the run goes on without it (it was killed by the
# signal, 129 to a shell). Only for attach, only in the main thread of a process started for it.
if _sys.argv[1:2] == ["attach"] and _signal.getsignal(_signal.SIGHUP) is _signal.SIG_DFL:
    _signal.signal(_signal.SIGHUP, lambda *_: _os._exit(8))
