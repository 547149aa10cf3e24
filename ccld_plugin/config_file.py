"""The text of a config file (``--config``, a job folder's ``ccld-config.yaml``): read only
from a regular file, at most MAX_CONFIG_BYTES of it, UTF-8, and never blocking. A folder, a
FIFO, a socket or a device is named as what it is, from its type, and never read."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ccld_plugin.config_values import ConfigError
from ccld_plugin.files import kind_of

__all__ = ["MAX_CONFIG_BYTES", "read_config_file"]

# A config is ~1 KB; YAML is parsed in pure Python (~6 s per MiB on a loaded 2-core host),
# and every rank of a job may read it.
MAX_CONFIG_BYTES = 64 * 1024
EXPECTED = "expected a YAML file like configs/default.yaml"


def read_config_file(path: Path, where: str) -> str:
    """The text of the config file at ``path`` (``where`` names it in errors)."""
    if "\0" in str(path):  # os.stat would raise ValueError
        raise ConfigError(f"ccld config: {where} does not exist (a NUL in its name)")
    try:
        # stat first: opening a device can have effects of its own, a FIFO can block
        _refuse_kind(os.stat(path).st_mode, where)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"ccld config: {where} {_why(exc)}") from None
    try:
        _refuse_kind(os.fstat(fd).st_mode, where)  # replaced since the stat
        data = _read_at_most(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"ccld config: {where} {_why(exc)}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"ccld config: {where} is larger than {MAX_CONFIG_BYTES // 1024} KiB; {EXPECTED} "
            "(a few KB)"
        )
    if b"\0" in data:
        raise ConfigError(f"ccld config: {where} is binary (it holds NUL bytes); {EXPECTED}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"ccld config: {where} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); {EXPECTED}"
        ) from None


def _refuse_kind(mode: int, where: str) -> None:
    if not stat.S_ISREG(mode):
        raise ConfigError(f"ccld config: {where} is {kind_of(mode)}; {EXPECTED}")


def _read_at_most(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _why(exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return "does not exist"
    if exc.errno == errno.ENOTDIR:
        return "does not exist (a part of its path is a file, not a folder)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "cannot be read: permission denied; give this user read access to it"
    return f"cannot be read ({exc.strerror or errno.errorcode.get(exc.errno or 0, 'error')})"
