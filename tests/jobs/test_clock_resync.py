"""Periodic clock re-sync with the diagnoser (the clocks of two hosts drift apart): the
protocol over a real TCPStore, and a real job whose ranks re-sync every second."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ccld_harness.launch import free_port
from ccld_plugin.config import ControlConfig
from ccld_plugin.control import ControlPlane
from ccld_plugin.sinks.jsonl import read_verdicts


def test_epoch_timestamps_give_the_offset_and_old_ones_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    cfg = ControlConfig(store="dedicated", port=free_port(), connect_timeout_s=10)
    diag = ControlPlane(cfg, 0, 2, "clk-test", 0)
    rank = ControlPlane(cfg, 1, 2, "clk-test", 0)
    diag.post_clock_epoch(1)
    poster = threading.Timer(0.2, diag.post_clock_epoch, args=(3,))
    poster.start()
    offset = rank.read_clock_epoch(3, timeout_s=5)  # waits for the post
    poster.join()
    # One host: the true offset is 0; what is measured is the smallest delivery delay.
    assert 0 <= offset < 50_000_000
    assert not rank.store.check(["clk/e1/0"])  # posting epoch 3 removed epoch 1
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - the store's timeout error
        rank.read_clock_epoch(9, timeout_s=0.3)
    assert time.monotonic() - t0 < 5


def test_ranks_resync_every_period_on_a_live_job(tmp_path: Path) -> None:
    from job_runner import run_job

    res = run_job("clock_resync.py", 4, tmp_path, (str(tmp_path),), timeout_s=120).check()
    for r in range(4):
        (got,) = res.json_lines(r, "CLOCK")
        assert got["resyncs"] >= 2, f"rank {r}: {got}"
        assert abs(got["offset_ns"]) < 100_000_000  # one host: ~0
    assert read_verdicts(tmp_path / "verdicts.jsonl") == []
