"""Clock re-sync estimates: a late handshake keeps the earlier estimate, aged by the drift
(the clocks of two hosts drift apart)."""

from __future__ import annotations


def test_a_late_resync_keeps_the_earlier_estimate_aged_by_the_drift() -> None:
    from ccld_plugin.control.clock import MAX_DRIFT_PPM, ClockSync

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
