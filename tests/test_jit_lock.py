"""A build lock left by a killed process no longer makes every later DeepSpeed run wait forever
(backends/jit_cache.clear_stale_lock); a lock some process is building under is left alone."""

import os
import subprocess
import sys
import time

import psutil

from shardconsole.backends.rank.jit_cache import clear_stale_lock, extension_dir


def test_stale_lock_removed_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = extension_dir("cpu_adam")
    folder.mkdir(parents=True)
    lock = folder / "lock"
    started = psutil.Process().create_time()

    # A lock created after this process started: a peer rank of the same run is building.
    lock.touch()
    os.utime(lock, (started + 5, started + 5))
    assert clear_stale_lock("cpu_adam", started) is None and lock.exists()

    # Older than this process, and a process works in the build folder (ninja's cwd): another run builds.
    os.utime(lock, (started - 60, started - 60))
    builder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], cwd=folder,
                               stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(builder.pid).cwd() != str(folder):     # until the child has started there
            assert time.monotonic() < deadline
        assert clear_stale_lock("cpu_adam", started) is None and lock.exists()
    finally:
        builder.communicate(b"")

    # Older than this process and nobody builds: left by a process that is gone.
    why = clear_stale_lock("cpu_adam", started)
    assert why is not None and str(lock) in why and not lock.exists()
    assert clear_stale_lock("cpu_adam", started) is None       # nothing there: nothing to say
