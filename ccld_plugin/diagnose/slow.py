"""Slowness: per window of steps, split every sampled collective into *wait* (how long the
early members waited for the last arriver) and *transfer* (from the last arrival to the
first exit), then name compute-bound stragglers (``compute.stragglers``) and
communication-bound slowness (``links.slow_communication``). The detector keeps what both
read: every rank's steps (``step_table``) and the collectives joined (``arrivals``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose.arrivals import ArrivalJoin, JoinedTable
from ccld_plugin.diagnose.compute.host_wait import QUIET_HOST_SHARE, cpu_wait
from ccld_plugin.diagnose.compute.stragglers import Stragglers
from ccld_plugin.diagnose.links.slow_communication import SlowCommunication
from ccld_plugin.diagnose.records import Verdict
from ccld_plugin.diagnose.step_table import StepTable
from ccld_plugin.diagnose.view import GroupIndex, JobView
from ccld_plugin.wire.summary import RankSummary
from ccld_plugin.wire.summary_batch import Summaries, table_of

__all__ = ["FIRST_STEP", "SlowDetector"]

FIRST_STEP = 1  # step 0 is warm-up (allocations, connection setup)
MAX_JOINED = 20000
SLIDE_MAX_RANKS = 1024  # larger jobs judge stragglers on windows end to end (evaluate)


class SlowDetector:
    def __init__(self, cfg: DiagnoserConfig, index: GroupIndex | None = None) -> None:
        self.cfg = cfg
        self.steps = StepTable()
        self.arrivals = ArrivalJoin(index)
        # the last MAX_JOINED collectives joined, and how many were ever joined
        self.joined = JoinedTable.empty(self.arrivals.groups)
        self.joined_total = 0
        self.next_end = FIRST_STEP + cfg.window_steps  # the step after the next window
        # Steps a straggler's excess is judged over: the confirming windows end to end, and
        # twice as many for a weak one (compute_excess).
        span = cfg.confirm_windows * cfg.window_steps
        self.spans = (span, 2 * span)
        self.stragglers = Stragglers(cfg, self.steps, self.spans)
        self.communication = SlowCommunication(cfg, self.arrivals.index, self.steps)

    # ------------------------------------------------------------------ ingest
    def ingest(self, view: JobView, fresh: Sequence[RankSummary]) -> None:
        """Take in ``fresh``: the summaries of the view not taken in before."""
        # their columns once for every reader below (a live round's come as columns)
        fresh = Summaries(table_of(fresh))
        self.stragglers.note_round(view.observer_round_ns)
        self.communication.channels.ingest(fresh)
        self.steps.ingest(fresh, self.next_end - max(self.spans) - self.cfg.window_steps)
        self.keep_joined(self.arrivals.add(view, fresh))
        self.communication.pipelines.ingest(view, fresh.table)

    def keep_joined(self, new: JoinedTable) -> None:
        """Keep ``new`` after the collectives joined before, the last MAX_JOINED of all."""
        self.joined_total += len(new)
        if len(new) >= MAX_JOINED:
            self.joined = new.since(len(new) - MAX_JOINED)
        elif len(new):
            both = JoinedTable.concat([self.joined, new])
            self.joined = both.since(len(both) - MAX_JOINED)

    def joined_since(self, total: int) -> tuple[JoinedTable, int]:
        """The collectives joined after the first ``total`` that are still kept, and how
        many were ever joined (the next call's ``total``)."""
        kept_from = self.joined_total - len(self.joined)
        return self.joined.since(total - kept_from), self.joined_total

    def next_window_start(self) -> int:
        return self.next_end - self.cfg.window_steps

    # ------------------------------------------------------------------ windows
    def evaluate(self, view: JobView) -> list[Verdict]:
        """Judge every step that all ranks have finished. Stragglers are judged at every
        step (over the spans ending there: a straggler is named as soon as its excess shows,
        wherever its onset falls); the bandwidth and link windows follow each other end to
        end, as the channel evidence needs whole agent intervals. Above SLIDE_MAX_RANKS
        ranks stragglers are judged once per window too: a judgement costs a pass over
        every rank's steps, and a round must stay within budget."""
        verdicts: list[Verdict] = []
        if not self._everyone_reported(view):
            return verdicts
        w = self.cfg.window_steps
        while True:
            lo, hi = self.next_end - w, self.next_end
            if not self.steps.all_reached(hi - 1):
                return verdicts
            self.next_end += 1 if len(self.steps.ranks()) <= SLIDE_MAX_RANKS else w
            verdicts += self._window(view, lo, hi, links=(hi - FIRST_STEP) % w == 0)

    def _everyone_reported(self, view: JobView) -> bool:
        """Whether every live rank has reported steps, or the job is old enough
        (``unresponsive_s``) that one still missing is the hang detector's. Windows go
        forward only: judged before a rank's first summary came (agents start a tick
        apart), they would leave its first steps out, and a stage without peers would
        take its slow steps for its baseline (a 2x stage of a 2-second job went unnamed)."""
        if view.final or len(self.steps.ranks()) >= view.world - len(view.gone):
            return True
        return view.now_ns - view.job_start_ns >= self.cfg.unresponsive_s * 1e9

    def _window(self, view: JobView, lo: int, hi: int, links: bool) -> list[Verdict]:
        window = self.steps.window(lo, hi)
        if window is None:
            return []
        t0, t1 = window.t0, window.t1
        # Windows go forward only; the samples of the longest straggler span are kept.
        keep_from = self.steps.first_start_ns(hi - max(self.spans))
        keep_from = t0 if keep_from is None else min(t0, keep_from)
        self.joined = self.joined.since_time(keep_from)
        pipelines = self.communication.pipelines
        pipelines.forget_before(keep_from)
        step_us = dict(zip(window.ranks, window.step_us, strict=True))
        stragglers = self.stragglers
        verdicts = stragglers.judge(view, step_us, hi - 1, t1, self.joined, pipelines.linked)
        if stragglers.solo and lo >= FIRST_STEP:
            # The first window's shorter prefixes count too (steps 1-2, 1-3, ...): a stage
            # slow from its third step has medians from before in its baseline.
            for end in range(lo + 2, hi) if lo == FIRST_STEP else ():
                stragglers.add_to_floors(self.steps.window(lo, end), lo, end)
            stragglers.add_to_floors(window, lo, hi)
        if links:
            verdicts += self.communication.judge(
                view,
                (lo, hi, t0, t1),
                self.joined,
                stragglers.slower,
                lambda: self._queued(lo, hi),
                self._first_steps(lo),
            )
        return verdicts

    def _queued(self, lo: int, hi: int) -> frozenset[int]:
        """The ranks that waited for a CPU over steps [lo, hi) (their host is busy)."""
        waited, _, share = cpu_wait(self.steps, lo, hi)
        return frozenset(waited[share > QUIET_HOST_SHARE].tolist())

    def _first_steps(self, lo: int) -> tuple[int, int] | None:
        """When steps 1-2 ran, if ``lo`` begins the job's first window: a pipeline's
        connections judged against their own past have those steps' as a past before it."""
        window = self.steps.window(FIRST_STEP, FIRST_STEP + 2) if lo == FIRST_STEP else None
        return None if window is None else (window.t0, window.t1)
