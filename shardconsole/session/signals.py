"""How a CLI front end meets signals and closed outputs: SIGTERM is Ctrl-C (the front end that started a
run stops it, attach detaches), SIGHUP (a closed terminal) detaches, a closed stdout is a quiet exit. The
run itself is in a session of its own and gets none of these: only the stop path signals it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator


class Detach(BaseException):
    """The front end goes away (its terminal closed): the run goes on without it. A BaseException, like
    KeyboardInterrupt: raised by the SIGHUP handler wherever the main thread is, it must not be taken for
    a failure by the `except Exception` guards it may land in (a probe's, in the watcher's tick), which
    swallowed it and left attach following a live run forever."""


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _hang_up(*_) -> None:
    raise Detach("the terminal closed (SIGHUP)")


@contextlib.contextmanager
def front_end_signals() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt and SIGHUP raises Detach in the main thread, for the duration;
    the previous handlers come back after (cli.main may be called in-process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {signal.SIGTERM: signal.signal(signal.SIGTERM, _interrupt),
           signal.SIGHUP: signal.signal(signal.SIGHUP, _hang_up)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def quiet_stdout() -> None:
    """A closed stdout pipe: point fd 1 at /dev/null so the interpreter's last flush does not complain."""
    try:
        sys.stdout.flush()
        return
    except (OSError, ValueError):
        pass
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):
        pass
