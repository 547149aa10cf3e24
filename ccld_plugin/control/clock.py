"""Every rank's clock against the diagnoser's: the offset a handshake through the store
measures, kept at its best estimate as the clocks drift (``ClockSync``), and the periods of
re-synchronisation (``resync_epoch``)."""

from __future__ import annotations

import time

__all__ = ["CLOCK_ROUNDS", "CLOCK_SPACING_S", "ClockSync", "resync_epoch"]

# A handshake's timestamps: each rank's offset is the smallest gap it sees between a post
# and its read, so a rank that is not running when one comes (descheduled, or its agent
# waiting for the GIL) reads it late. Five posts 10 ms apart all came late to some ranks
# of a loaded host: offsets of 5-16 ms on one host (true offset 0), more than the arrival
# skew of a TP collective. Spread over half a second, one post is likely caught at once.
CLOCK_ROUNDS = 10
CLOCK_SPACING_S = 0.05
# Quartz oscillators are specified to +-20..100 ppm; NTP-disciplined hosts stay within a few.
MAX_DRIFT_PPM = 100


def resync_epoch(diag_ns: int, period_s: float) -> int:
    """Clock re-sync periods passed at ``diag_ns`` on the diagnoser's clock (0 when off):
    epoch n's timestamps are posted once its clock passes n x period."""
    return int(diag_ns // int(period_s * 1e9)) if period_s else 0


class ClockSync:
    """This rank's monotonic clock against the diagnoser's: ``offset_ns`` is ours minus
    theirs; ``job_start_ns`` is the diagnoser's start, on its clock."""

    def __init__(self, offset_ns: int, job_start_ns: int) -> None:
        self.offset_ns = offset_ns
        self.job_start_ns = job_start_ns
        # The best handshake so far and when it was taken (our clock): a measured offset
        # is the truth plus a delivery delay, so lower is better, up to the clocks' drift.
        self._best = (offset_ns, time.monotonic_ns())

    def take(self, measured_ns: int, now_ns: int) -> bool:
        """A re-sync's measured offset. It replaces the best one unless that one, aged by
        the most the clocks can have drifted since (MAX_DRIFT_PPM), is still lower: then
        this handshake's posts reached us late and the aged estimate stands. True when
        the measurement was taken."""
        best, at = self._best
        aged = best + (now_ns - at) * MAX_DRIFT_PPM // 1_000_000
        if measured_ns <= aged:
            self._best = (measured_ns, now_ns)
            self.offset_ns = measured_ns
            return True
        self.offset_ns = aged
        return False

    def to_diag(self, mono_ns: int) -> int:
        return mono_ns - self.offset_ns

    def job_seconds(self, mono_ns: int) -> float:
        return (mono_ns - self.offset_ns - self.job_start_ns) / 1e9
