"""Opening the files the plugin writes during a job: never through a symbolic link (a link
planted where the plugin writes would have it overwrite the link's target), never a FIFO
or a device (an open of a FIFO blocks until a reader comes), mode 0600 when created."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["open_private", "replace_private"]


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
