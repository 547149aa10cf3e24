"""Slowness: per window of steps, split every sampled collective into *wait* (how long the
early members waited for the last arriver) and *transfer* (from the last arrival to the
first exit), then name

- a compute-bound straggler: a rank whose compute time, step by step, stays above its
  cohort's by ``slow_ratio`` and by ``excess_z`` standard errors over whole windows
  (``compute_excess``), and that its peers wait for (it arrives last); or one whose time
  outside communication does so only with its wait for a CPU counted, while its cohort
  hardly waits: its host's other work takes its cores (a noisy neighbour);
- communication-bound slowness: a group whose transfer bandwidth is an outlier against its
  sibling groups of the same role or against its own history; slow groups of different
  roles are intersected to find the common rank; slow links in the channel evidence, or
  in the pipelines' messages' transfers (p2p_transfers).
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose.arrivals import ArrivalJoin, JoinedTable, RankJoined
from ccld_plugin.diagnose.compute.compute_excess import Excess, compute_excess
from ccld_plugin.diagnose.links.pipeline_links import PipelineLinks
from ccld_plugin.diagnose.links.slow_links import ChannelHistory, LinkFinding
from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.diagnose.robust import RankedValues, RecentFloor
from ccld_plugin.diagnose.step_table import StepTable, StepWindow
from ccld_plugin.diagnose.view import GroupIndex, JobView
from ccld_plugin.errors import log
from ccld_plugin.topology import GroupInfo, Topology
from ccld_plugin.wire.summary import RankSummary
from ccld_plugin.wire.summary_batch import Summaries, table_of

__all__ = ["SlowDetector"]

FIRST_STEP = 1  # step 0 is warm-up (allocations, connection setup)
# Compute is judged from this step on: the first steps of a job also hold compilation,
# the data loader's first fill and the other ranks' start-up, and on a shared host they
# swing the most (healthy 8-rank jobs on 2 cores had ranks 1.6-2x their cohort over steps
# 1-14); a straggler from the start is named once this many steps have gone by.
WARMUP_STEPS = 10
MAX_JOINED = 20000
SLIDE_MAX_RANKS = 1024  # larger jobs judge stragglers on windows end to end (evaluate)
MIN_ARRIVAL_SAMPLES = 4
# A straggler's peers wait for it: of the waiting in its sampled collectives (theirs for it
# when it arrives last, its own for others), theirs is at least this share. Weighed by time,
# not counted: a rank whose compute is stretched before some collectives only is last by a
# hair at the others, a coin toss that a share of arrivals counted (a 2x straggler of a
# 2-core TP2xPP2xDP2 job measured 33% last arrivals in a window). Injected stragglers of
# 1.2-2x had 64-100% (most above 80%); healthy ranks that a busy 2-core host held back for
# 10-20 steps, 50-56% as well (benchmarks/replay_runs.py over ~70 recorded runs).
WAITED_FOR_SHARE = 0.65
# Clear-cut: an injected straggler, slowed before every collective, had 80-100% of the
# waiting in its streak; ranks of a healthy 8-rank job on 2 cores that the host's
# scheduler held back for ~10 steps had 60-79%. Below this share a straggler is confirmed
# over the longer span only, which such an episode rarely lasts.
CLEAR_WAITED_FOR_SHARE = 0.8
# An excess of this many times ``excess_z`` is confirmed over the shorter span by an
# arrival order that is not clear-cut (WAITED_FOR_SHARE). A live 1.5x straggler of a
# two-rank cohort measured 6-8 standard errors with 72-75% of the waiting its peers';
# healthy ranks held back by the host never reached it (replayed over ~130 runs).
CLEAR_EXCESS_Z = 2.0
# Such a strong excess needs only this share: four ranks of DP4 on two cores take turns at
# the CPUs, and 1.5x stragglers sleeping their excess stood 10-11 standard errors at
# 54-64% of the waiting (one all-reduce a step); healthy ranks that a busy host held back
# reached 50-56%, but never the strong excess (replayed over this session's 13 healthy and
# 40 faulty recordings, loaded host included: no new verdict).
STRONG_WAITED_FOR_SHARE = 0.5
# A rank that no other rank matches in work is compared by its change against its own
# baseline, the lowest of its windows: on a shared host that baseline sits low by their
# noise. Stages of healthy pipelines on 2 cores (Megatron and torch, 4 and 8 stages, 7
# runs of 200-300 steps) stood up to 1.4-1.9x theirs at 6.0-7.3 standard errors (most
# under 4.5), and a two-stage one's first stage 1.27x at 9.2, the other stage all its
# reference; 2x slow stages reached 12-15 within 10-15 steps of onset, 3x ones stood
# 19-30 from the first span judged. So such a rank is named at SOLO_EXCESS_Z x excess_z
# standard errors, among at least SOLO_MIN_RANKS of them: a two-stage pipeline's stages
# (a 2-rank TP1xPP2 job) are each other's reference. Its healthy stage that stood 9.2 is
# under that bar; healthy 300-step TP1xPP2 torch and Megatron jobs (6 runs, 2 beside busy
# processes) never stood 1.2x their baseline; 1.5x and 2x stages were named 7-12 steps
# after onset (benchmarks/sensitivity.py --layouts tp1pp2).
SOLO_MIN_RANKS = 2
SOLO_EXCESS_Z = 4.0
# ... and it is the stage its pipeline waits for: its time outside communication (compute
# and wait for a CPU) grew more, in ms per step over its own floor, than the other stages'
# did (their median). Every stage of a pipeline takes the same step time, so the others'
# wait grows by what the slow one adds; a stage that changed more by its own measure but
# added less is not what holds the pipeline up. A host that slows every stage changes each
# by its own measure: beside a busy CI run a healthy stage of a TP1xPP2 job went from 21
# to 53 ms/step (2.5x its floor) while the 1.5x stage's grew by more ms, and the healthy
# one was named.
# Such a rank's baseline: this quantile of its last BASELINE_WINDOWS windows' medians (a
# window a step, sliding). Their lowest, as before, is set by the luckiest five steps,
# and falls the longer the job runs: a stage of a healthy TP1xPP4 job beside two busy
# processes stood 1.25x its lowest at 12.6 standard errors at step 86 (its compute 19-23
# ms, its lowest window 16.8) and was named. (1.3x stages on a quiet host stood 8-12.)
BASELINE_QUANTILE = 0.1
BASELINE_WINDOWS = 512
# A rank of a cohort that far above it (SOLO_EXCESS_Z x excess_z, where a rank with no
# arrival evidence at all is named; healthy recorded ranks stood at most 7.3 standard
# errors above their cohort or baseline) needs no share of the waiting: another fault can
# take most of it (a 5x straggler beside a 100 Mbit/s link of the same ring had 25-65%,
# the link holding everyone up in the other collectives; a 2x one of TP3xDP2, 47% over
# 125 samples). It must only be on the critical path: where it arrived last, its peers
# waited for it, on average, at least DECISIVE_WAIT_OF_EXCESS of its excess compute
# before one collective (the arrival-order test it replaces is there for compute that
# nobody waits for).
DECISIVE_WAIT_OF_EXCESS = 0.5
# A straggler is slower than its cohort in every window of the span it is judged over
# (but the first, where its onset may lie: a job of more than SLIDE_MAX_RANKS judges spans
# on window boundaries, and would wait a window more for every onset inside one): on
# a shared host the scheduler holds healthy ranks back for a few steps at a time, and over
# the hundreds of spans a job is judged on, such episodes add up to 3 standard errors now
# and then (healthy 8-rank Megatron TP1xPP4xDP2 on 2 cores: a rank of a two-rank cohort
# named at 1.4-1.6x in 3 of 3 runs of 150-200 steps, each with a window at 0.7-0.9x).
STEADY_PART_RATIO = 1.0
MIN_STEP_SHARE = 0.05  # excess compute below 5% of the step time is noise, not a verdict
# A rank held back by its host: its cohort waits for a CPU less than this share of its time
# outside communication (with a core per rank, ~0), and its own excess wait makes at
# least HOST_WAIT_SHARE of its excess. Where every rank queues for a CPU (more busy threads
# than cores, as on this project's 2-core VM) one held back for a while is the scheduler
# taking turns, not a fault of its node (healthy 8-rank jobs: 1.4-2.2x for 10-25 steps).
QUIET_HOST_SHARE = 0.15
HOST_WAIT_SHARE = 0.5
# ... and over the longer span only if that span lasted this long: the scheduler's turns
# are a matter of time, not of steps (the episodes above: ten steps of 0.1-0.2 s; an
# unseen DTensor job of 25 ms steps on 2 cores had a rank held back for 20 steps, 0.5 s,
# at 1.33x and 3.1 standard errors, with nothing else running).
HOST_MIN_HELD_S = 2.0
# The diagnoser's rounds kept, to tell how long they ran within a span of its rank's steps
# (_rounds_within): a span of the longest kind at one rank spans a few dozen at most.
OBSERVER_ROUNDS = 64
# Such a rank is named once it has been held back over the longer span, or by a decisive
# excess (SOLO_EXCESS_Z x excess_z, as above): a busy host's scheduler also favours some
# ranks over others for about ten steps at a time (two healthy torch jobs beside two busy
# processes on 2 cores: 1.84x and 1.93x over ten steps at 3.7 and 5.1 standard errors,
# their cohorts hardly waiting), and a noisy neighbour stays (one sharing a rank's core
# stood 13-25 standard errors within 3-12 steps of its first span).
# A group's transfer bandwidth must fall this far below its siblings' (and below its own
# history, once it has one) to count: small transfers on a busy host vary by 2x.
COMM_RATIO = 2.5
# A verdict that names a link (two ranks) waits this many windows more than one that names
# a rank: it also clears the other connections of both ends, and their evidence (light,
# often one-way flows: slow_links.PORT_RATIO) gathers more slowly than the slow link's; a
# window in between that shows one end's port slow names that rank instead.
LINK_EXTRA_WINDOWS = 1
# Bandwidth is only meaningful for transfers large enough not to be all latency.
MIN_BANDWIDTH_BYTES = 256 * 1024
MIN_TRANSFER_NS = 10_000


class SlowDetector:
    def __init__(self, cfg: DiagnoserConfig, index: GroupIndex | None = None) -> None:
        self.cfg = cfg
        self.steps = StepTable()
        self.arrivals = ArrivalJoin(index)
        # the last MAX_JOINED collectives joined, and how many were ever joined
        self.joined = JoinedTable.empty(self.arrivals.groups)
        self.joined_total = 0
        self.pipelines = PipelineLinks(self.arrivals.index)  # their messages, paired
        self.next_end = FIRST_STEP + cfg.window_steps  # the step after the next window
        # Steps a straggler's excess is judged over: the confirming windows end to end, and
        # twice as many for a weak one (compute_excess).
        span = cfg.confirm_windows * cfg.window_steps
        self.spans = (span, 2 * span)
        self.streak: dict[tuple, int] = defaultdict(int)
        self.first_seen: dict[tuple, int] = {}
        self.bw_history: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=20))
        self.channels = ChannelHistory()  # per-peer TCP evidence: names the slow link's rank
        self.slower: set[int] = set()  # ranks computing slower than their cohort just now
        self._slow_since: dict[int, int] = {}  # of those: the first step they were slow over
        # Stragglers with a verdict: told once per job, as the analyzer tells any finding
        # once; one slow again after a pause is the same straggler.
        self._straggler_told: set[int] = set()
        # when the diagnoser's rounds ran, on its own rank (the observer's)
        self._observer_rounds: deque[tuple[int, int]] = deque(maxlen=OBSERVER_ROUNDS)
        self._channel_found: LinkFinding | None = None  # of the current streak
        self._comm_reported: set[tuple] = set()  # communication streaks with a verdict
        self._cohort_key = -1
        self._linked_seen: set[int] = set()  # ranks with messages whose cohort was checked
        self._cohort_cache: dict[int, list[int]] = {}
        # Ranks that no other rank matches in work (one per pipeline stage: TP1 x PPn x
        # DP1): compared with each other by how their compute changed, each against its
        # own baseline, a low quantile of the medians of its windows so far (a
        # straggler's slow windows hardly move it).
        self._solo: list[int] = []
        self._baselines: dict[int, RecentFloor] = {}
        self._busy_floors: dict[int, RecentFloor] = {}  # theirs with the wait for a CPU

    # ------------------------------------------------------------------ ingest
    def ingest(self, view: JobView, fresh: Sequence[RankSummary]) -> None:
        """Take in ``fresh``: the summaries of the view not taken in before."""
        # their columns once for every reader below (a live round's come as columns)
        fresh = Summaries(table_of(fresh))
        ran = view.observer_round_ns
        if ran is not None and (not self._observer_rounds or self._observer_rounds[-1] != ran):
            self._observer_rounds.append(ran)
        self.channels.ingest(fresh)
        self.steps.ingest(fresh, self.next_end - max(self.spans) - self.cfg.window_steps)
        self.keep_joined(self.arrivals.add(view, fresh))
        self.pipelines.ingest(view, fresh.table)

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
        self.pipelines.forget_before(keep_from)
        step_us = dict(zip(window.ranks, window.step_us, strict=True))
        verdicts = self._stragglers(view, step_us, hi - 1, t1)
        if self._solo and lo >= FIRST_STEP:
            # The first window's shorter prefixes count too (steps 1-2, 1-3, ...): a stage
            # slow from its third step has medians from before in its baseline.
            for end in range(lo + 2, hi) if lo == FIRST_STEP else ():
                self._add_to_floors(self.steps.window(lo, end), lo, end)
            self._add_to_floors(window, lo, hi)
        if links:
            verdicts += self._slow_links(view, lo, hi, t0, t1)
        return verdicts

    def _add_to_floors(self, window: StepWindow | None, lo: int, hi: int) -> None:
        """Add the window's medians of the ranks compared by their change to their floors:
        compute, and compute with the wait for a CPU."""
        if window is None:
            return
        solo = set(self._solo)
        busy = self._busy_medians(lo, hi)
        for r, c in zip(window.ranks, window.compute_us, strict=True):
            if r in solo and c > 0 and r in busy:
                for floors, value in ((self._baselines, c), (self._busy_floors, busy[r])):
                    if r not in floors:
                        floors[r] = RecentFloor(BASELINE_QUANTILE, BASELINE_WINDOWS)
                    floors[r].add(value)

    def _busy_gains(self, first: int, last: int) -> dict[int, float]:
        """Per rank compared by its change: how much its time outside communication over
        steps first..last grew over its floor (us per step)."""
        busy = self._busy_medians(first, last + 1)
        return {r: busy[r] - f.value for r, f in self._busy_floors.items() if r in busy}

    def _busy_medians(self, lo: int, hi: int) -> dict[int, float]:
        """Per rank with steps in [lo, hi): its median time outside communication."""
        ranks, busy = self.steps.matrix(lo, hi, ("compute_us", "cpu_wait_us"))
        has = ~np.isnan(busy).all(axis=1)
        medians = np.nanmedian(busy[has], axis=1) if has.any() else []
        return dict(zip(ranks[has].tolist(), list(medians), strict=True))

    def _stragglers(
        self, view: JobView, step_us: dict[int, float], last: int, t1: int
    ) -> list[Verdict]:
        """Stragglers as of step ``last`` (ending at ``t1``): ranks whose compute exceeds
        their cohort's over a span of steps (compute_excess), by enough of the step time
        to matter, and whose peers waited for them over that span (the arrival order)."""
        cohorts = self._cohorts(view.topology)
        solo = [r for r in self._solo if r in self._baselines]
        baselines = None
        if len(solo) >= SOLO_MIN_RANKS:
            baselines = {r: self._baselines[r].value for r in solo}
            cohorts = {**cohorts, **dict.fromkeys(solo, solo)}
        found = compute_excess(
            self.steps,
            cohorts,
            last,
            self.spans,
            self.cfg.slow_ratio,
            self.cfg.excess_z,
            first=WARMUP_STEPS,
            baselines=baselines,
            part_steps=self.cfg.window_steps,
        )
        held = self._held_by_host(self._cohorts(view.topology), last, {e.rank for e in found})
        self.slower = {e.rank for e in found} | held.keys()
        for r in list(self._slow_since):
            if r not in self.slower:
                del self._slow_since[r]
        out = []
        for e, host_wait in [(e, None) for e in found] + list(held.values()):
            if e.rank in self._straggler_told:
                continue
            cohort = cohorts.get(e.rank, [e.rank])
            if e.rank == view.observer and e.ratio * (1 - view.observer_load) < self.cfg.slow_ratio:
                # The diagnosis' own threads hold this rank's GIL for that share of its time.
                why = f"{view.observer_load:.0%} of its time is the diagnoser's, on its rank"
                _not_a_straggler(e, cohort, why)
                continue
            rounds_us = self._rounds_within(e) if e.rank == view.observer else 0.0
            if (e.compute_us - e.cohort_us) * e.steps <= rounds_us:
                # A round holds its rank's GIL in a burst: steps of a few ms under it wait
                # for the GIL between their ops, a slower stretch that a load averaged over
                # seconds does not show. Its whole excess fits in the rounds' time.
                why = (
                    f"its excess, {(e.compute_us - e.cohort_us) * e.steps / 1000:.1f} ms over "
                    f"{e.steps} steps, fits in the {rounds_us / 1000:.1f} ms the diagnoser's "
                    "rounds ran on its rank during them"
                )
                _not_a_straggler(e, cohort, why)
                continue
            cohort_step_us = statistics.median(
                [step_us[c] for c in cohort if c in step_us] or [0.0]
            )
            # A straggler worth a verdict costs the job a real share of its step time.
            if e.compute_us - e.cohort_us < MIN_STEP_SHARE * cohort_step_us:
                why = (
                    f"excess {(e.compute_us - e.cohort_us) / 1000:.1f} ms < "
                    f"{MIN_STEP_SHARE:.0%} of the step"
                )
                _not_a_straggler(e, cohort, why)
                continue
            if not e.lowest_part >= STEADY_PART_RATIO:
                why = (
                    "not slower in every window of the span after its first (one at "
                    f"{e.lowest_part:.2f}x): an episode, not a straggler"
                )
                _not_a_straggler(e, cohort, why)
                continue
            if host_wait is None and held.keys() & set(cohort):
                busy = self._busy_medians(e.first, e.last + 1)
                others = [busy[c] for c in cohort if c != e.rank and c in busy]
                if e.rank in busy and others and busy[e.rank] <= statistics.median(others):
                    # Its cohort computes less only because a member waits for a CPU (held
                    # back by its host): with that wait counted they are the slower ones,
                    # and it is not this rank that they wait for.
                    why = (
                        f"{busy[e.rank] / 1000:.1f} ms/step outside communication, its cohort "
                        f"{statistics.median(others) / 1000:.1f} with their wait for a CPU"
                    )
                    _not_a_straggler(e, cohort, why)
                    continue
            # The arrival order over the steps it has been slow in (since its first span),
            # the longer span's at most.
            since = self._slow_since.setdefault(e.rank, e.first)
            start = self.steps.start_from_ns(e.rank, max(since, last - max(self.spans) + 1), last)
            mine = self._streak_samples(e.rank, t1 if start is None else start, t1)
            balance = _wait_balance(e.rank, mine)
            longest = last - since + 1 >= max(self.spans)
            if host_wait is not None and longest:
                longest = self._held_s(e.rank, since, last) >= HOST_MIN_HELD_S
            strong = e.z >= CLEAR_EXCESS_Z * self.cfg.excess_z
            decisive = e.z >= SOLO_EXCESS_Z * self.cfg.excess_z
            gains = self._busy_gains(e.first, e.last) if e.rank in self._solo else {}
            if e.rank in self._solo:
                why = _solo_not_confirmed(e, self.cfg.excess_z, gains)
            elif host_wait is not None and not (longest or decisive):
                why = f"held back by its host {last - since + 1} steps: the longer span decides"
            else:
                why = _not_waited_for(len(cohort), mine, balance.share, longest, strong)
                if why and decisive:
                    why = _not_decisive(e, mine, balance, step_us.get(e.rank, 0.0))
            if why:
                _not_a_straggler(e, cohort, why)
                continue
            self._straggler_told.add(e.rank)
            out.append(self._straggler_verdict(view, e, cohort, mine, balance, host_wait, gains))
        return out

    def _held_by_host(
        self, cohorts: dict[int, list[int]], last: int, stragglers: set[int]
    ) -> dict[int, tuple[Excess, _HostWait]]:
        """Ranks (not ``stragglers``) slower than their cohort only with their wait for a
        CPU counted, that wait theirs alone: their cohort hardly waits (QUIET_HOST_SHARE)
        and their own excess wait makes HOST_WAIT_SHARE of their excess. A rank compared
        by its change (no cohort) is not judged so."""
        # Who waits for a CPU at all over the longer span (on a node with a core per rank,
        # nobody: then nothing more is done); only their cohorts are judged.
        lo = last - max(self.spans) + 1
        ranks, wait, share = self._cpu_wait(lo, last + 1)
        waiting = set(ranks[share > QUIET_HOST_SHARE].tolist()) - stragglers - set(self._solo)
        if not waiting:
            return {}
        found = compute_excess(
            self.steps,
            {r: cohorts[r] for r in waiting if r in cohorts},
            last,
            self.spans,
            self.cfg.slow_ratio,
            self.cfg.excess_z,
            first=WARMUP_STEPS,
            part_steps=self.cfg.window_steps,
            fields=("compute_us", "cpu_wait_us"),
        )
        out = {}
        row = {r: i for i, r in enumerate(ranks.tolist())}
        for e in found:
            span = wait[:, e.first - lo :]  # its span ends at ``last`` too
            others = [row[c] for c in cohorts.get(e.rank, ()) if c != e.rank and c in row]
            if e.rank not in row or not others:
                continue
            w = _HostWait(float(np.nanmedian(span[row[e.rank]])), float(np.nanmedian(span[others])))
            if w.cohort_us > QUIET_HOST_SHARE * e.cohort_us:
                why = f"its cohort waits for a CPU too ({w.cohort_us / 1000:.1f} ms/step)"
            elif w.mine_us - w.cohort_us < HOST_WAIT_SHARE * (e.compute_us - e.cohort_us):
                why = f"its wait for a CPU ({w.mine_us / 1000:.1f} ms/step) is not its excess"
            else:
                out[e.rank] = (e, w)
                continue
            _not_a_straggler(e, cohorts.get(e.rank, [e.rank]), f"with its CPU wait: {why}")
        return out

    def _rounds_within(self, e: Excess) -> float:
        """How long (us) the diagnoser's rounds ran on its rank (the observer's) within
        the steps of ``e``."""
        span = self.steps.span_ns(e.rank, e.first, e.last) if self._observer_rounds else None
        if span is None:
            return 0.0
        rounds = np.array(self._observer_rounds, np.int64)
        within = np.minimum(rounds[:, 1], span[1]) - np.maximum(rounds[:, 0], span[0])
        return float(np.clip(within, 0, None).sum()) / 1000

    def _held_s(self, rank: int, since: int, last: int) -> float:
        """Seconds from the start of step ``since`` to that of step ``last`` of ``rank``."""
        first = self.steps.start_from_ns(rank, since, last)
        end = self.steps.start_ns(rank, last)
        return 0.0 if first is None or end is None else (end - first) / 1e9

    def _cpu_wait(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ranks with steps, their wait for a CPU per step in steps [lo, hi) (us, NaN
        where unknown), and its share of their time outside communication."""
        ranks, wait = self.steps.matrix(lo, hi, ("cpu_wait_us",))
        _, busy = self.steps.matrix(lo, hi, ("compute_us", "cpu_wait_us"))
        with np.errstate(all="ignore"):
            share = np.nansum(wait, axis=1) / np.nansum(busy, axis=1)
        return ranks, wait, share

    def _streak_samples(self, r: int, t0: int, t1: int) -> RankJoined:
        """Rank r's joined collectives (of groups of two or more) between t0 and t1."""
        j = self.joined
        return j.of_rank(r, (t0 <= j.time_ns) & (j.time_ns <= t1) & (j.size > 1))

    def _cohorts(self, topo: Topology) -> dict[int, list[int]]:
        """Statistics cohort of every rank, recomputed only when the topology changes."""
        key = len(topo.groups)
        changed = self._cohort_key != key
        if changed:
            cohorts = topo.cohorts()  # a list per distinct cohort, shared by its ranks
            small = [r for r, c in cohorts.items() if len(c) < 3]
            if small:  # their pipeline stage may make a larger cohort
                stages: dict[int | None, list[int]] = defaultdict(list)
                for r in topo.ranks():
                    stages[topo.stage_of(r)].append(r)
                for r in small:
                    cohorts[r] = _stats_cohort(topo, r, cohorts[r], stages)
            self._cohort_cache = cohorts
            self._cohort_key = key
            self._linked_seen = set()
        # Ranks that message each other with no group to place them (stages of a pipeline
        # on the world group, as torch.distributed.pipelining runs them) hold different
        # parts of the model, not copies of one: each is its own cohort, judged by its
        # change. Compared as peers, a healthy pipeline's middle stages stood 1.3-2x the
        # median stage, its first and last doing less work.
        new = self.pipelines.linked - self._linked_seen
        self._linked_seen |= new
        for r in new:
            if not topo.placed(r):
                self._cohort_cache[r] = [r]
                changed = True
        if changed:
            cohorts = self._cohort_cache
            self._solo = sorted(r for r, c in cohorts.items() if len(c) == 1)
            if len(self._solo) < SOLO_MIN_RANKS:
                self._solo = []
        return self._cohort_cache

    def _straggler_verdict(
        self,
        view: JobView,
        e: Excess,
        cohort: list[int],
        mine: RankJoined,
        balance: _WaitBalance,
        host_wait: _HostWait | None = None,
        gains: dict[int, float] | None = None,
    ) -> Verdict:
        r = e.rank
        imposed: dict[int, float] = defaultdict(float)
        groups: dict[int, GroupInfo] = {}
        group: GroupInfo | None  # None for a rank in no dp, tp or world group
        at_last = mine.last == r
        theirs = (mine.waits_ns - mine.own_wait_ns)[at_last]  # the others' waits for r
        for g, waited in zip(mine.group[at_last].tolist(), theirs.tolist(), strict=True):
            info = mine.groups[g]
            imposed[info.group_id] += waited
            groups[info.group_id] = info
        solo = r in self._solo
        if imposed:
            group = groups[max(imposed, key=imposed.__getitem__)]
        else:
            group = (
                (view.topology.group_of(r, "pp") if solo else None)
                or view.topology.group_of(r, "dp")
                or view.topology.group_of(r, "tp")
                or view.topology.group_of(r, "world")
            )
        onset_ns = self.steps.start_from_ns(r, e.first, e.last)
        # (the record's data in the sentence's order)
        compute_ms = e.compute_us / 1000
        measured = dict(
            cohort=cohort,
            ratio=e.ratio,
            z=e.z,
            first_step=e.first,
            last_step=e.last,
        )
        if host_wait is not None:
            excess = Evidence.of(
                "cpu_wait",
                "waited for a CPU {wait_ms:.1f} ms/step vs {cohort_wait_ms:.1f} ms median of its "
                "cohort {cohort}: other work on its host ({host}) takes its cores; with that "
                "wait, {busy_ms:.1f} ms/step outside communication vs {median_ms:.1f} ms "
                "({ratio:.2f}x, step by step, {z:.1f} standard errors) over steps "
                "{first_step}-{last_step}",
                wait_ms=host_wait.mine_us / 1000,
                cohort_wait_ms=host_wait.cohort_us / 1000,
                host=view.summaries[r].host if r in view.summaries else "?",
                busy_ms=compute_ms,
                median_ms=e.cohort_us / 1000,
                **measured,
            )
        elif solo:
            excess = Evidence.of(
                "compute_change",
                "compute {compute_ms:.1f} ms/step vs {baseline_ms:.1f} ms at its fastest "
                "before (its windows' low tenth); no other rank does its work, so it is "
                "compared by that change with "
                "ranks {cohort} ({ratio:.2f}x theirs, step by step, {z:.1f} standard errors) "
                "over steps {first_step}-{last_step}",
                compute_ms=compute_ms,
                baseline_ms=self._baselines[r].value / 1000,
                **measured,
            )
        else:
            excess = Evidence.of(
                "compute_excess",
                "compute {compute_ms:.1f} ms/step vs {median_ms:.1f} ms median of its cohort "
                "{cohort} ({ratio:.2f}x, step by step, {z:.1f} standard errors above its "
                "cohort) over steps {first_step}-{last_step}",
                compute_ms=compute_ms,
                median_ms=e.cohort_us / 1000,
                **measured,
            )
        evidence = [excess]
        others = _others_gain(gains or {}, r)
        if gains and others is not None:
            # Its peers' arrival order is the pipeline's drain; what they wait for is this.
            evidence.append(
                Evidence.of(
                    "pipeline_waits",
                    "its time outside communication grew {gain_ms:.1f} ms/step over its "
                    "fastest before, the other stages' {others_ms:.1f} ms (median): the "
                    "pipeline waits for it",
                    gain_ms=gains[r] / 1000,
                    others_ms=others / 1000,
                )
            )
        elif balance.share is not None and mine:
            waited = balance.for_r_ns / balance.last_n / 1e6 if balance.last_n else 0.0
            evidence.append(
                Evidence.of(
                    "waited_for",
                    "last to arrive in {last_share:.0%} of {samples} sampled collectives of "
                    "its {roles:join(/)} groups; peers waited {wait_ms:.1f} ms per op, "
                    "{waited_share:.0%} of the waiting in them",
                    last_share=balance.last_n / len(mine),
                    samples=len(mine),
                    roles=sorted({mine.groups[g].role for g in mine.group.tolist()}),
                    wait_ms=waited,
                    waited_share=balance.share,
                )
            )
        return Verdict(
            kind=Kind.SLOW,
            cause=Cause.COMPUTE,
            ranks=[r],
            group=group.to_dict() if group else None,
            step=e.last,
            onset_s=view.seconds(onset_ns) if onset_ns is not None else None,
            detected_s=view.seconds(view.now_ns),
            severity=round(e.ratio, 2),
            evidence=evidence,
        )

    def _first_steps(self, lo: int) -> tuple[int, int] | None:
        """When steps 1-2 ran, if ``lo`` begins the job's first window: a pipeline's
        connections judged against their own past have those steps' as a past before it."""
        window = self.steps.window(FIRST_STEP, FIRST_STEP + 2) if lo == FIRST_STEP else None
        return None if window is None else (window.t0, window.t1)

    def _slow_links(self, view: JobView, lo: int, hi: int, t0: int, t1: int) -> list[Verdict]:
        bw, groups = _group_bandwidth(self.joined, t0, t1)
        by_role: dict[str, dict[int, float]] = defaultdict(dict)
        for gid, b in bw.items():
            by_role[groups[gid].role][gid] = b
        ranked = {role: RankedValues(v) for role, v in by_role.items()}
        stragglers = self.slower
        slow: list[tuple[GroupInfo, float, float]] = []
        for gid, b in bw.items():
            g = groups[gid]
            # Bandwidth alone is compared against siblings only: a lone group's drop has
            # many causes (a busy host); naming a link then needs channel evidence.
            siblings = ranked[g.role]
            sib = siblings.median_without([gid]) if len(siblings) > 1 else None
            history = list(self.bw_history[gid])
            ref = None
            if (
                sib is not None
                and b * COMM_RATIO < sib
                and (len(history) < 2 or b * COMM_RATIO < statistics.median(history))
            ):
                ref = sib
            if ref is None:
                self.bw_history[gid].append(b)
            elif stragglers & set(g.ranks):
                # A member that computes late (a straggler being confirmed) delays the
                # group's transfers too: it explains the low bandwidth.
                _not_slow(
                    lo,
                    hi,
                    g,
                    b,
                    ref,
                    f"explained by straggler(s) {sorted(stragglers & set(g.ranks))}",
                )
            else:
                slow.append((g, b, ref))
        # Channel evidence names the rank (or link) common to the slow connections, also
        # where no sibling group exists to compare bandwidth with (one DP group).
        judged = self.channels.slow_links(view, t0, t1, frozenset(stragglers))
        found, fresh = judged.found, judged.fresh
        healthy: frozenset[int] | None = None  # ranks whose links it measured; None: all
        if self.pipelines.measured():
            waited, _, share = self._cpu_wait(lo, hi)
            found, fresh, healthy = self.pipelines.judge(
                view,
                self.channels,
                (lo, hi, t0, t1),
                judged,
                frozenset(stragglers),
                queued=frozenset(waited[share > QUIET_HOST_SHARE].tolist()),
                first_steps=self._first_steps(lo),
            )
        if slow and found is None and judged.pending:
            # Low bandwidth with the links' own judgement still to come: a busy host slows
            # a group's transfers as much as a slow link does (seen: one DP group at 5.6x
            # its siblings in a healthy 8-rank run on 2 cores). Wait for the links.
            for g, b, ref in slow:
                _not_slow(lo, hi, g, b, ref, "its links are not judged yet")
            return []
        # A group whose own connections were measured and found healthy did not move slowly
        # on the network: its members were slow to run (a busy host, a straggler's TP peer),
        # and that is no communication verdict of its own. Where the channels name a slow
        # link or port outside it (this window or, too short to judge, the last one), that
        # is the verdict: a member held up on a slow connection elsewhere (a pipeline's,
        # seen) is late to this group's transfers too.
        cleared = [
            x
            for x in slow
            if judged.measured.within(x[0].ranks)
            and (fresh if found is None else not set(found.ranks) <= set(x[0].ranks))
        ]
        for g, b, ref in cleared:
            _not_slow(lo, hi, g, b, ref, "but its links are healthy")
        slow = [x for x in slow if x not in cleared]
        if not slow:
            if found is None:
                self._end_comm_streaks(healthy)
                return []
            # A window too short for the channel evidence holds its streak as it is.
            return self._channel_slow(view, found, lo, hi) if fresh else []
        common = set(slow[0][0].ranks)
        for g, _, _ in slow[1:]:
            common &= set(g.ranks)
        ranks = sorted(common) if common else sorted(set().union(*(g.ranks for g, _, _ in slow)))
        link = None
        if fresh and found is not None:
            found = self._narrowed(found)
        if found is not None and set(found.ranks) <= set().union(*(g.ranks for g, _, _ in slow)):
            ranks, link = found.ranks, found.link
        worst = min(slow, key=lambda s: s[1] / s[2])
        key = self._comm_streak(ranks, lo)
        if not self._comm_due(key, link, found is None or found.settled):
            return []
        g, b, ref = worst
        evidence = [
            Evidence.of(
                "group_bandwidth",
                "{role}{members} moves {mb_s:.1f} MB/s vs {ref_mb_s:.1f} MB/s for its "
                "siblings / history",
                role=sg.role,
                members=list(sg.ranks),
                mb_s=sb / 1e6,
                ref_mb_s=sref / 1e6,
            )
            for sg, sb, sref in slow
        ]
        if len(slow) > 1:
            evidence.append(
                Evidence.of(
                    "groups_intersect", "slow groups intersect in ranks {ranks}", ranks=ranks
                )
            )
        if found is not None:
            evidence += found.evidence
        return [
            Verdict(
                kind=Kind.SLOW,
                cause=Cause.COMMUNICATION,
                ranks=ranks,
                group=g.to_dict(),
                link=link,
                step=hi - 1,
                onset_s=self._onset(view, key, ranks),
                detected_s=view.seconds(view.now_ns),
                severity=round(ref / b, 2),
                evidence=evidence,
            )
        ]

    def _end_comm_streaks(self, healthy: frozenset[int] | None) -> None:
        """End the communication streaks on ranks in ``healthy`` (None: every streak)."""
        for key in [k for k in self.streak if k[:2] == (Kind.SLOW, Cause.COMMUNICATION)]:
            if healthy is None or set(key[2]) <= healthy:
                self.streak.pop(key)
                self.first_seen.pop(key, None)
                self._comm_reported.discard(key)
        if not any(k[:2] == (Kind.SLOW, Cause.COMMUNICATION) for k in self.streak):
            self._comm_reported.clear()
            self._channel_found = None

    def _narrowed(self, found: LinkFinding) -> LinkFinding:
        """``found``, or the streak's earlier finding where that named one end of the link
        ``found`` names (a window that could only name the link does not undo one end)."""
        prev = self._channel_found
        if prev is not None and set(prev.ranks) < set(found.ranks):
            found = prev
        self._channel_found = found
        return found

    def _comm_streak(self, ranks: list[int], lo: int) -> tuple:
        """Count this window's communication-bound finding on ``ranks``; its streak key.
        The same finding narrowed (link 0<->1, then rank 1) or widened keeps its count, by
        the channel evidence or by the groups' bandwidth; a different culprit starts over."""
        key = (Kind.SLOW, Cause.COMMUNICATION, tuple(ranks))
        for other in [k for k in self.streak if k[:2] == key[:2] and k != key]:
            count, first = self.streak.pop(other), self.first_seen.pop(other, lo)
            reported = other in self._comm_reported
            self._comm_reported.discard(other)
            if set(other[2]) & set(ranks):
                self.streak[key] = max(self.streak[key], count)
                self.first_seen[key] = min(self.first_seen.get(key, first), first)
                if reported:  # told once: narrowed later, it is not told again
                    self._comm_reported.add(key)
        self.streak[key] += 1
        self.first_seen.setdefault(key, lo)
        return key

    def _comm_due(self, key: tuple, link: list[int] | None, settled: bool) -> bool:
        """Whether the streak ``key`` is confirmed now (and ``settled``: its finding can be
        told) and not reported yet (then it is)."""
        needed = self.cfg.confirm_windows + (LINK_EXTRA_WINDOWS if link is not None else 0)
        if not settled or self.streak[key] < needed or key in self._comm_reported:
            return False
        self._comm_reported.add(key)
        return True

    def _channel_slow(self, view: JobView, found: LinkFinding, lo: int, hi: int) -> list[Verdict]:
        """Communication-bound slowness seen in the channel evidence alone."""
        found = self._narrowed(found)
        key = self._comm_streak(found.ranks, lo)
        if not self._comm_due(key, found.link, found.settled):
            return []
        g = found.group
        return [
            Verdict(
                kind=Kind.SLOW,
                cause=Cause.COMMUNICATION,
                ranks=found.ranks,
                group=g.to_dict() if g is not None else None,
                link=found.link,
                step=hi - 1,
                onset_s=self._onset(view, key, found.ranks),
                detected_s=view.seconds(view.now_ns),
                severity=found.severity,
                evidence=found.evidence,
            )
        ]

    def _onset(self, view: JobView, key: tuple, ranks: list[int]) -> float | None:
        """Start of the first window in which the finding was seen."""
        first = self.first_seen.get(key)
        starts = [
            start
            for r in ranks
            if first is not None and (start := self.steps.start_ns(r, first)) is not None
        ]
        return view.seconds(min(starts)) if starts else None


class _HostWait(NamedTuple):
    """A rank's median wait for a CPU per step over a span, and its cohort's (us)."""

    mine_us: float
    cohort_us: float


class _WaitBalance(NamedTuple):
    """Rank r's joined collectives: its peers' waiting for it (their mean wait where r
    arrived last, summed), r's waiting for them, and how often r arrived last."""

    for_r_ns: float
    by_r_ns: float
    last_n: int

    @property
    def share(self) -> float | None:
        """Of the waiting, the share that is its peers' for it; None when nobody waited."""
        total = self.for_r_ns + self.by_r_ns
        return self.for_r_ns / total if total > 0 else None


def _wait_balance(r: int, mine: RankJoined) -> _WaitBalance:
    shared = mine.count >= 2
    last = shared & (mine.last == r)
    # where r arrived last, the others' mean wait; elsewhere r's own wait (sums are taken
    # in the collectives' order, one after another, as a loop over them would)
    theirs = (mine.waits_ns - mine.own_wait_ns)[last] / (mine.count[last] - 1)
    own = mine.own_wait_ns[shared & ~last].astype(np.float64)
    for_r = float(np.cumsum(theirs)[-1]) if len(theirs) else 0.0
    by_r = float(np.cumsum(own)[-1]) if len(own) else 0.0
    return _WaitBalance(for_r, by_r, int(last.sum()))


def _group_bandwidth(
    joined: JoinedTable, t0: int, t1: int
) -> tuple[dict[int, float], dict[int, GroupInfo]]:
    """Per group (by id, in the order of their first collective among ``joined``): its
    transfer bandwidth (bytes per second of transfer) over the large transfers of the
    collectives of [t0, t1], where it has enough of them; and every group with a large
    transfer there."""
    j = joined
    large = (t0 <= j.time_ns) & (j.time_ns <= t1) & (j.bytes >= MIN_BANDWIDTH_BYTES) & (j.size > 1)
    group = j.group[large]
    order = np.argsort(group, kind="stable")
    ordered = group[order]
    new = np.ones(len(ordered), bool)
    new[1:] = ordered[1:] != ordered[:-1]
    starts = np.flatnonzero(new)
    if not len(starts):
        return {}, {}
    count = np.diff(np.append(starts, len(ordered)))
    nbytes = np.add.reduceat(j.bytes[large][order], starts)
    transfer = np.add.reduceat(j.transfer_ns[large][order], starts)
    by_first = np.argsort(order[starts], kind="stable")  # the order of first appearance
    bw: dict[int, float] = {}
    groups: dict[int, GroupInfo] = {}
    for g, n, b, x in zip(
        *(a[by_first].tolist() for a in (ordered[starts], count, nbytes, transfer)), strict=True
    ):
        info = j.groups[g]
        groups[info.group_id] = info
        if n >= MIN_ARRIVAL_SAMPLES and x >= MIN_TRANSFER_NS * n:
            bw[info.group_id] = b / x * 1e9
    return bw, groups


def _not_waited_for(
    cohort_size: int, mine: RankJoined, waited_for: float | None, longest: bool, strong: bool
) -> str:
    """Why the collectives ``mine`` of a rank slower than its cohort do not show its peers
    waiting for it (yet; empty when they do). With a cohort too small for statistics the
    arrival order has to decide, so it must have more samples; an order that is not
    clear-cut counts only over the ``longest`` span, or for a ``strong`` excess."""
    small = cohort_size < 3
    need_n = MIN_ARRIVAL_SAMPLES * (2 if small else 1)
    if not mine and not small:  # none taken: the cohort's statistics decide, over more steps
        return "" if longest else "no arrival samples: the longer span decides"
    if len(mine) < need_n:  # a few: more come while it stays slow
        return f"{len(mine)} arrival samples in its span (< {need_n})"
    floor = STRONG_WAITED_FOR_SHARE if strong else WAITED_FOR_SHARE
    if waited_for is None or waited_for < floor:
        share = "none" if waited_for is None else f"{waited_for:.0%}"
        return (
            f"its peers waiting for it are {share} of the waiting in {len(mine)} samples "
            f"(< {floor:.0%})"
        )
    if waited_for < CLEAR_WAITED_FOR_SHARE and not (longest or strong):
        return (
            f"its peers waiting for it are {waited_for:.0%} of the waiting "
            f"(< {CLEAR_WAITED_FOR_SHARE:.0%}): the longer span decides"
        )
    return ""


def _not_decisive(e: Excess, mine: RankJoined, balance: _WaitBalance, step_us: float) -> str:
    """Why a rank with a decisive excess is not shown on the critical path: where it
    arrived last, its peers' mean wait for it is short of DECISIVE_WAIT_OF_EXCESS of its
    excess compute before one collective (its excess a step over the collectives it runs
    a step; empty when it is not)."""
    excess_ns = (e.compute_us - e.cohort_us) * 1000 / mine.ops_per_step(step_us * 1000)
    waited_ns = balance.for_r_ns / balance.last_n if balance.last_n else 0.0
    if waited_ns >= DECISIVE_WAIT_OF_EXCESS * excess_ns:
        return ""
    return (
        f"where it arrived last ({balance.last_n} samples) its peers waited "
        f"{waited_ns / 1e6:.1f} ms for it, < {DECISIVE_WAIT_OF_EXCESS:.0%} of its excess "
        f"before a collective ({excess_ns / 1e6:.1f} ms)"
    )


def _solo_not_confirmed(e: Excess, excess_z: float, gains: dict[int, float]) -> str:
    """Why a rank compared by its change (no other rank does its work) is not named. The
    collectives it has with its peers are ordered by the pipeline's drain, not by who is
    slow (a 3x middle stage of a live 4-stage Megatron pipeline arrived last in none of
    them): its excess must be clear (SOLO_EXCESS_Z), and its added time the pipeline's
    to wait for (``gains``: each such rank's growth over its floor, us per step)."""
    if e.z < SOLO_EXCESS_Z * excess_z:
        return f"compared by its change: {e.z:.1f} < {SOLO_EXCESS_Z:g} x excess_z standard errors"
    others = _others_gain(gains, e.rank)
    if others is not None and gains[e.rank] <= others:
        return (
            f"its time outside communication grew {gains[e.rank] / 1000:.1f} ms/step, the "
            f"other stages' {others / 1000:.1f}: they do not wait for it"
        )
    return ""


def _others_gain(gains: dict[int, float], r: int) -> float | None:
    """The median of the other ranks' ``gains``; None without r's or any other's."""
    others = [g for s, g in gains.items() if s != r]
    return statistics.median(others) if r in gains and others else None


def _not_a_straggler(e: Excess, cohort: list[int], why: str) -> None:
    """Log a rank slower than its cohort that is no straggler (yet), and why."""
    log.debug(
        "ccld steps %d-%d: rank %d computes %.2fx its cohort %s (z %.1f), not a straggler: %s",
        e.first,
        e.last,
        e.rank,
        e.ratio,
        cohort,
        e.z,
        why,
    )


def _not_slow(lo: int, hi: int, g: GroupInfo, b: float, ref: float, why: str) -> None:
    """Log a group whose low bandwidth is not a communication finding, and why."""
    log.debug(
        "ccld window %d-%d: %s%s moves %.1f MB/s vs %.1f, %s",
        lo,
        hi - 1,
        g.role,
        list(g.ranks),
        b / 1e6,
        ref / 1e6,
        why,
    )


def _stats_cohort(
    topo: Topology, rank: int, cohort: list[int], stages: dict[int | None, list[int]]
) -> list[int]:
    """Ranks whose compute time should match ``rank``'s: its DP peers (``cohort``, its
    ``topo.cohort``) when there are enough for statistics, else every rank of its pipeline
    stage (TP peers do equal work)."""
    if len(cohort) >= 3:
        return cohort
    same_stage = stages[topo.stage_of(rank)]
    return same_stage if len(same_stage) > len(cohort) else cohort
