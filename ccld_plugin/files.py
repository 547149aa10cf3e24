"""Opening the plugin's files safely. What it writes during a job is never opened through
a symbolic link (a link planted where the plugin writes would have it overwrite the link's
target), nor as a FIFO or a device, and is created with mode 0600. What a reader takes must
be a regular file, opened without ever blocking (a FIFO opened for reading waits for a
writer, a device can be endless, a socket cannot be opened at all): anything else, and
every OS error, is one line that names the path and what is wrong, whatever it quotes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

__all__ = [
    "FileError",
    "OneLineError",
    "kind_of",
    "make_private_dirs",
    "one_line",
    "open_private",
    "open_regular",
    "os_problem",
    "replace_private",
]


# ------------------------------------------------------------------ what the plugin writes
def open_private(path: Path, *, append: bool = False) -> int:
    """A descriptor open for writing on the regular file at ``path``, created (mode 0600)
    if missing; appended to, or emptied. OSError naming ``path`` when it is a link or not
    a regular file, or cannot be opened."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | (os.O_APPEND if append else 0), 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(
                exc.errno, "is a symbolic link; not written through it", str(path)
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "is not a regular file; not written", str(path))
        if not append:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_private(path: Path, data: bytes) -> None:
    """Replace ``path`` with a file holding ``data`` (mode 0600), atomically: a reader sees
    the old content or the new. The temporary file is created fresh, under a name nobody
    can guess (``O_EXCL``), and the rename replaces a link at ``path``, not its target."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------- what readers take
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents with mode 0700 (``Path.mkdir(parents=True)``
    would give the parents the umask's mode). One that another process creates meanwhile
    is taken as it is."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass


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
