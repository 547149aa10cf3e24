"""The files the post-mortem commands write (``trace -o``, ``--jsonl``): in a folder that
exists (none is created unasked), never through a symbolic link or into a FIFO or a
device, never over an existing file unless asked (``--force``); every OS error is one line
that names the path."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from ccld_plugin.files import kind_of, os_problem
from ccld_plugin.postmortem.boards import PostmortemError

__all__ = ["check_folder", "check_new", "existing", "open_append", "replace_file"]


def check_folder(path: Path) -> None:
    """Refuse ``path`` when the folder it would be written in is not an existing folder."""
    folder = path.parent
    try:
        mode = os.stat(folder).st_mode
    except FileNotFoundError:
        raise PostmortemError(
            f"{folder}: the folder does not exist; create it or give another path"
        ) from None
    except OSError as exc:
        raise PostmortemError(os_problem(folder, exc, "used")) from None
    if not stat.S_ISDIR(mode):
        raise PostmortemError(f"{folder}: {kind_of(mode)}, not a folder; give another path")


def existing(path: Path) -> int | None:
    """The mode of what is at ``path`` itself (a link is not followed), None if nothing."""
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PostmortemError(os_problem(path, exc, "looked at")) from None


def check_new(path: Path, force: bool) -> None:
    """Refuse to write ``path`` as a new file: its folder missing, something there that is
    not a regular file, or a file there and not ``force``."""
    check_folder(path)
    mode = existing(path)
    if mode is None:
        return
    if not stat.S_ISREG(mode):
        raise PostmortemError(f"{path}: {kind_of(mode)}, not a regular file; give another path")
    if not force:
        raise PostmortemError(f"{path} exists; pass --force to replace it, or give another path")


def replace_file(path: Path, data: bytes, force: bool) -> None:
    """Write ``data`` as the file ``path`` (see :func:`check_new`), all or nothing: a
    temporary file beside it renamed over it, so that a failed write (a full disk) leaves
    what was there."""
    check_new(path, force)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise PostmortemError(os_problem(path, exc, "written")) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise PostmortemError(os_problem(path, exc, "written")) from None


def open_append(path: Path, force: bool) -> int:
    """A descriptor to append to ``path``, created (mode 0600) if missing, in an existing
    folder. Only a regular file that is not a link, unless ``force`` (then a link is
    followed and a FIFO or a device written to, e.g. /dev/stdout)."""
    check_folder(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
    if not force:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        mode = existing(path)
        if mode is not None and not stat.S_ISREG(mode):
            raise PostmortemError(_not_regular(path, mode)) from None
        raise PostmortemError(os_problem(path, exc, "opened")) from None
    mode = os.fstat(fd).st_mode
    if not force and not stat.S_ISREG(mode):
        os.close(fd)
        raise PostmortemError(_not_regular(path, mode))
    # non-blocking was for the open (a FIFO with no reader); writes wait as usual
    os.set_blocking(fd, True)
    return fd


def _not_regular(path: Path, mode: int) -> str:
    return (
        f"{path}: {kind_of(mode)}, not a regular file; give another path, or pass --force "
        "to write to it"
    )
