"""Periodic clock re-sync with the diagnoser (the clocks of two hosts drift apart): the
protocol over a real TCPStore, and a real job whose ranks re-sync every second."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ccld_plugin.config import ControlConfig
from ccld_plugin.control import ControlPlane
from ccld_plugin.harness.launch import free_port
from ccld_plugin.sinks.jsonl import read_verdicts


def test_epoch_timestamps_give_the_offset_and_old_ones_go(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
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


def test_a_late_resync_keeps_the_earlier_estimate_aged_by_the_drift() -> None:
    from ccld_plugin.control import MAX_DRIFT_PPM, ClockSync

    s = 1_000_000_000
    clock = ClockSync(2_000_000, 0)  # 2 ms: the truth plus the best delivery delay
    t0 = clock._best[1]
    # A minute later a re-sync measures 12 ms (its posts came 10 ms late): no clock drifts
    # 10 ms a minute, so the first estimate stands, aged by the most it can have drifted.
    assert not clock.take(12_000_000, t0 + 60 * s)
    assert clock.offset_ns == 2_000_000 + 60 * MAX_DRIFT_PPM * 1000
    # A better measurement (or a real drift downward) is taken at once.
    assert clock.take(1_500_000, t0 + 120 * s) and clock.offset_ns == 1_500_000
    # A drift upward within the bound is followed too.
    up = 1_500_000 + 30 * 50 * 1000  # 50 ppm over 30 s
    assert clock.take(up, t0 + 150 * s) and clock.offset_ns == up


def test_ranks_resync_every_period_on_a_live_job(tmp_path: Path) -> None:
    from jobs import run_job

    res = run_job("clock_resync.py", 4, tmp_path, (str(tmp_path),), timeout_s=120).check()
    for r in range(4):
        (got,) = res.json_lines(r, "CLOCK")
        assert got["resyncs"] >= 2, f"rank {r}: {got}"
        assert abs(got["offset_ns"]) < 100_000_000  # one host: ~0
    assert read_verdicts(tmp_path / "verdicts.jsonl") == []
