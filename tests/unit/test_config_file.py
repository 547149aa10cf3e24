"""``--config`` on what is not a config file: one line that says what the path is (a
folder, a device, a FIFO, a socket, missing, unreadable, binary, not UTF-8, too big), and
nothing blocks. An empty file is the defaults."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ccld_plugin.cli import main
from ccld_plugin.config import CcldConfig, ConfigError, load_config

NOBODY = 65534


def _said(path: Path | str, message: str) -> str:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert "\n" not in str(info.value)
    return str(info.value)


@contextlib.contextmanager
def _as_nobody() -> Iterator[None]:
    """This process's file access as user nobody's (root reads any file)."""
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.mark.timeout(30)  # a FIFO opened to read blocks until a writer comes
def test_a_fifo_is_named_and_never_opened_to_block(tmp_path):
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    _said(fifo, r"file '.*c.yaml' is a FIFO \(named pipe\); expected a YAML file like")


def test_a_socket_is_named(tmp_path):
    path = tmp_path / "c.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        _said(path, r"c.sock' is a socket; expected a YAML file")


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/dev/zero", r"file '/dev/zero' is a character device; expected a YAML file"),
        ("/tmp", r"file '/tmp' is a folder; expected a YAML file"),
        ("/proc/self/mem", r"file '/proc/self/mem' cannot be read \(Input/output error\)"),
    ],
)
def test_a_path_that_is_not_a_config_file_says_what_it_is(path, message):
    _said(path, message)


def test_a_missing_file_says_so_and_which_part_is_a_file(tmp_path):
    _said(tmp_path / "c.yaml", r"c.yaml' does not exist$")
    (tmp_path / "f").write_text("")
    _said(tmp_path / "f" / "c.yaml", r"does not exist \(a part of its path is a file, not a")


def test_an_unreadable_file_says_permission_denied(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("job: x\n")
    path.chmod(0o600)
    with _as_nobody():
        _said(path, r"c.yaml' cannot be read: permission denied; give this user read access")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"job: x\x00\x01\n", r"is binary \(it holds NUL bytes\)"),
        ("job: caf\xe9\n".encode("latin-1"), r"is not UTF-8 text \(byte 0xe9 at offset 8\)"),
        (b"job: " + b"[" * 2000 + b"\n", r"nests too deeply"),
        (b"diagnoser:\n  rank: 1\n  rank: 2\n", r"line 3: diagnoser.rank is given twice"),
    ],
)
def test_a_file_that_is_not_yaml_text_says_what_it_holds(tmp_path, data, message):
    path = tmp_path / "c.yaml"
    path.write_bytes(data)
    _said(path, message)


def test_at_most_64_kib_are_read_and_an_empty_file_is_the_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    for text in ("", "\n\n", "# nothing set yet\n", "#" * (64 * 1024 - 1) + "\n"):
        path.write_text(text)
        assert load_config(path) == CcldConfig()
    path.write_text("#" * 64 * 1024 + "\n")
    _said(path, r"is larger than 64 KiB; expected a YAML file like configs/default.yaml \(a few")


def test_the_cli_names_a_folder_and_dev_zero_in_one_line(tmp_path, capsys):
    for path, kind in ((tmp_path, "a folder"), ("/dev/zero", "a character device")):
        assert main(["config", "--config", str(path)]) == 2
        out = capsys.readouterr()
        assert out.out == ""
        expected = f"file '{path}' is {kind}; expected a YAML file like configs/default.yaml"
        assert out.err == f"ccld: error: ccld config: {expected}\n"
