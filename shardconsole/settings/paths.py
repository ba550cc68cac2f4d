"""What a path names, found by stat() alone, before anything opens it.

open() of a FIFO blocks until a writer comes (for ever, on a path typed by mistake), a character device
may never end, and a path of a few thousand characters raises ENAMETOOLONG from the first call that
touches it. Every path the user gives (data.path, data.eval_path, model.name, a preset, a run folder) is
asked here first, so each of those is one line naming the path, never a hang or a traceback.
Standard library only: the console, the settings layer and the ranks all ask.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# Longest piece of a path that a message quotes; a 5000-character path is shown by its start and length.
_SHOWN_CHARS = 80
# The errors that mean "no such thing here" (a part of the path missing or not a folder).
_MISSING = (errno.ENOENT, errno.ENOTDIR)


class PathError(ValueError):
    """A path that cannot be looked at: str() is one line naming it and why."""


def shown(path: str | os.PathLike[str]) -> str:
    """The path as a message quotes it: whole when short, else its start and its length."""
    text = str(path)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def kind_of(path: str | os.PathLike[str]) -> str:
    """"file", "folder", "missing", or what else it is ("a FIFO", "a socket", "a character device",
    "a block device"), from stat() (symlinks followed; a dangling one is missing). PathError for any
    other OSError (ENAMETOOLONG, EACCES on a parent, ELOOP), as one line."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno in _MISSING:
            return "missing"
        raise PathError(f"{shown(path)}: {e.strerror or e}") from None
    except ValueError:      # an embedded NUL byte
        raise PathError(f"{shown(path)}: not a valid path (it holds a NUL character)") from None
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def regular_file(path: Path, what: str = "a regular file") -> str:
    """kind_of(path) when it is "file" or "missing"; PathError naming what it is otherwise (a folder,
    a FIFO, a device): the caller may then open() it without blocking."""
    kind = kind_of(path)
    if kind in ("file", "missing"):
        return kind
    it = "a folder" if kind == "folder" else kind
    raise PathError(f"{shown(path)}: is {it}, not {what}")


def is_path_error(e: OSError) -> bool:
    """An OSError about a path the user gave (too long, a part not a folder, no permission, a loop),
    said as one line, not a failure of the program."""
    return e.filename is not None and e.errno in (
        errno.ENAMETOOLONG, errno.ENOTDIR, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ELOOP,
        errno.EISDIR, errno.ENXIO, errno.EROFS)


def error_line(e: OSError) -> str:
    return f"{shown(e.filename)}: {e.strerror or e}"
