"""Opening a file that must be a regular file, for reading, without ever blocking: a FIFO
opened for reading waits for a writer, a device can be endless (/dev/zero), a socket
cannot be opened at all. Each is refused with one line that names the path and what it is,
as is every OS error; the lines stay one line whatever path they quote.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["FileError", "OneLineError", "kind_of", "one_line", "open_regular", "os_problem"]

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)

# control characters as Python writes them in a string's repr
_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(32), 127)}


def one_line(text: str) -> str:
    """``text`` with its control characters escaped (a path may hold a newline): one
    line, whatever it quotes."""
    return text.translate(_ESCAPES)


class OneLineError(ValueError):
    """An error whose message is one line, whatever it quotes (see :func:`one_line`)."""

    def __str__(self) -> str:
        return one_line(super().__str__())


class FileError(OneLineError):
    """A path that cannot be used as the regular file expected; the message is one line
    that names the path and what is wrong."""


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO (named pipe)", "a folder", ...)."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def os_problem(path: str | os.PathLike[str], exc: OSError, doing: str = "read") -> str:
    """One line for an OS error on ``path``: the path, what failed and the system's reason
    ("/x/v.jsonl: cannot be written (Read-only file system)")."""
    return f"{path}: cannot be {doing} ({exc.strerror or exc})"


def open_regular(path: str | os.PathLike[str], what: str) -> int:
    """A read-only descriptor of the regular file at ``path`` (the caller closes it).
    ``what`` names what the file should be, for the message ("a board file"). Raises
    :class:`FileError` for anything else, and for every OS error."""
    try:
        # O_NONBLOCK: a FIFO opens at once instead of waiting for a writer; on a regular
        # file the flag changes nothing.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise FileError(_refused(Path(path), exc, what)) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise FileError(os_problem(path, exc)) from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileError(f"{path}: {kind_of(mode)}, not {what}")
    return fd


def _refused(path: Path, exc: OSError, what: str) -> str:
    """Why ``path`` could not be opened: what it is when that is the reason (a socket
    cannot be opened; the OS says "No such device or address"), else the OS's reason."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return os_problem(path, exc, "opened")
    if stat.S_ISREG(mode):
        return os_problem(path, exc, "opened")
    return f"{path}: {kind_of(mode)}, not {what}"
