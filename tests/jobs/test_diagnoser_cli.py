"""``ccld diagnoser`` (the diagnoser as a process of its own) on bad input and on a store
that is not there: one line and exit 2, within ``control.connect_timeout_s``; and on a
real IPv6 TCPStore, written ``[ADDR]:PORT``."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist


def _diagnoser(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ccld_plugin.cli", "diagnoser", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _unused_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_error_line(proc: subprocess.Popen, timeout: float) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 2, out + err
    (line,) = err.strip().splitlines()
    assert line.startswith("ccld: error: ccld diagnoser: ") and out == "", out + err
    return line


# Each would, unchecked, wait for a store (port 0 for ever); the store's timeout is short
# so that a case that is not refused fails quickly.
@pytest.mark.parametrize(
    "args, message",
    [
        (("--store", "127.0.0.1:0"), "port 0 is not one a store can listen on"),
        (("--store", "127.0.0.1:65536"), "port 65536 is not one a store can listen on"),
        (("--store", "::1:29500"), "an IPv6 address goes in brackets"),
        (("--store", "[nohost]:29500"), "'nohost' in brackets is not an IPv6 address"),
        (("--store", "127.0.0.1"), "expected HOST:PORT"),
        (("--job", "../../etc"), "--job '../../etc' is not allowed; expected 1-63 of"),
        (("--world", "99999999"), "--world 99999999 is not allowed; expected the job's"),
        (("--world", "0"), "--world 0 is not allowed"),
    ],
)
def test_bad_options_are_one_line(args: tuple[str, ...], message: str) -> None:
    given = dict(zip(args[::2], args[1::2], strict=True))
    store = given.pop("--store", f"127.0.0.1:{_unused_port()}")
    world = given.pop("--world", "2")
    rest = [x for kv in given.items() for x in kv]
    proc = _diagnoser("--store", store, "--world", world, *rest)
    try:
        line = _one_error_line(proc, timeout=30)
    finally:
        proc.kill()
    assert message in line, line


def test_no_store_listening_is_one_line_within_the_connect_timeout() -> None:
    timeout_s = 8
    port = _unused_port()
    started = time.monotonic()
    proc = _diagnoser(
        "--store", f"127.0.0.1:{port}", "--world", "2",
        "--set", f"control.connect_timeout_s={timeout_s}",
    )  # fmt: skip
    try:
        line = _one_error_line(proc, timeout=120)
    finally:
        proc.kill()
    elapsed = time.monotonic() - started
    assert f"nothing answers at 127.0.0.1:{port} (connection refused" in line, line
    assert "start the job first, or check --store" in line, line
    # It waits the whole timeout (the job may be starting), and not much more: the rest
    # is this process's start (torch's import) on a busy 2-core host. torch's client
    # alone took twice the timeout.
    assert timeout_s <= elapsed < timeout_s + 8, elapsed


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")
def test_an_ipv6_store_in_brackets_is_served() -> None:
    store = dist.TCPStore("::1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
    job = dist.PrefixStore("ccld/v6job/", store)
    proc = _diagnoser(
        "--store", f"[::1]:{store.port}", "--world", "1", "--job", "v6job",
        "--set", "agent.interval_s=0.5", "--set", "control.connect_timeout_s=10",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not job.check(["diag/owner"]) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert job.check(["diag/owner"]), "the diagnoser never took the lease over [::1]"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    assert f"store [::1]:{store.port}" in err and "Traceback" not in err, err
