"""Stragglers: ranks whose compute time, step by step, stays above their cohort's by
``slow_ratio`` and by ``excess_z`` standard errors over whole windows (``compute_excess``),
and that their peers wait for (``confirmation``); or whose time outside communication
does so only with their wait for a CPU counted, while their cohort hardly waits: their
host's other work takes their cores (a noisy neighbour, ``host_wait``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque

import numpy as np

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose.arrivals import JoinedTable, RankJoined
from ccld_plugin.diagnose.compute.compute_excess import (
    WARMUP_STEPS,
    Excess,
    compute_excess,
    not_a_straggler,
)
from ccld_plugin.diagnose.compute.confirmation import (
    CLEAR_EXCESS_Z,
    SOLO_EXCESS_Z,
    SOLO_MIN_RANKS,
    WaitBalance,
    not_decisive,
    not_waited_for,
    others_gain,
    solo_not_confirmed,
    wait_balance,
)
from ccld_plugin.diagnose.compute.host_wait import HOST_MIN_HELD_S, HostWait, held_by_host, held_s
from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.diagnose.robust import RecentFloor
from ccld_plugin.diagnose.step_table import StepTable, StepWindow
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo, Topology

__all__ = ["BASELINE_QUANTILE", "BASELINE_WINDOWS", "Stragglers"]

# The baseline of a rank compared by its change (no other rank does its work): this
# quantile of its last BASELINE_WINDOWS windows' medians (a window a step, sliding). Their
# lowest would be set by the luckiest five steps, and falls the longer the job runs: a
# stage of a healthy TP1xPP4 job beside two busy processes stood 1.25x its lowest at 12.6
# standard errors at step 86 (its compute 19-23 ms, its lowest window 16.8): named by it.
# (1.3x stages on a quiet host stood 8-12.)
BASELINE_QUANTILE = 0.1
BASELINE_WINDOWS = 512
# A straggler is slower than its cohort in every window of the span it is judged over
# (but the first, where its onset may lie: a job of more than SLIDE_MAX_RANKS judges spans
# on window boundaries, and would wait a window more for every onset inside one): on
# a shared host the scheduler holds healthy ranks back for a few steps at a time, and over
# the hundreds of spans a job is judged on, such episodes add up to 3 standard errors now
# and then (healthy 8-rank Megatron TP1xPP4xDP2 on 2 cores: a rank of a two-rank cohort
# named at 1.4-1.6x in 3 of 3 runs of 150-200 steps, each with a window at 0.7-0.9x).
STEADY_PART_RATIO = 1.0
MIN_STEP_SHARE = 0.05  # excess compute below 5% of the step time is noise, not a verdict
# The diagnoser's rounds kept, to tell how long they ran within a span of its rank's steps
# (_rounds_within): a span of the longest kind at one rank spans a few dozen at most.
OBSERVER_ROUNDS = 64


class Stragglers:
    """The straggler judgement of the slow detector's windows, and what it keeps across
    them: who is slower now, who was told, the cohorts, the baselines of the ranks compared
    by their change."""

    def __init__(self, cfg: DiagnoserConfig, steps: StepTable, spans: tuple[int, int]) -> None:
        self.cfg = cfg
        self.steps = steps  # the detector's, shared
        self.spans = spans  # steps an excess is judged over (compute_excess)
        self.slower: set[int] = set()  # ranks computing slower than their cohort just now
        self._slow_since: dict[int, int] = {}  # of those: the first step they were slow over
        # Stragglers with a verdict: told once per job, as the analyzer tells any finding
        # once; one slow again after a pause is the same straggler.
        self._straggler_told: set[int] = set()
        # when the diagnoser's rounds ran, on its own rank (the observer's)
        self._observer_rounds: deque[tuple[int, int]] = deque(maxlen=OBSERVER_ROUNDS)
        self._cohort_key = -1
        self._linked_seen: set[int] = set()  # ranks with messages whose cohort was checked
        self._cohort_cache: dict[int, list[int]] = {}
        # Ranks that no other rank matches in work (one per pipeline stage: TP1 x PPn x
        # DP1): compared with each other by how their compute changed, each against its
        # own baseline, a low quantile of the medians of its windows so far (a
        # straggler's slow windows hardly move it).
        self.solo: list[int] = []
        self._baselines: dict[int, RecentFloor] = {}
        self._busy_floors: dict[int, RecentFloor] = {}  # theirs with the wait for a CPU

    def note_round(self, ran: tuple[int, int] | None) -> None:
        """A diagnoser round ran on the observer's rank (start and end, ns): its time there
        is not the rank's compute."""
        if ran is not None and (not self._observer_rounds or self._observer_rounds[-1] != ran):
            self._observer_rounds.append(ran)

    def judge(
        self,
        view: JobView,
        step_us: dict[int, float],
        last: int,
        t1: int,
        joined: JoinedTable,
        linked: set[int],
    ) -> list[Verdict]:
        """Stragglers as of step ``last`` (ending at ``t1``): ranks whose compute exceeds
        their cohort's over a span of steps (compute_excess), by enough of the step time
        to matter, and whose peers waited for them over that span (the arrival order of
        ``joined``). ``linked``: ranks that message each other (pipelines' stages)."""
        cohorts = self._cohorts(view.topology, linked)
        solo = [r for r in self.solo if r in self._baselines]
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
        held = held_by_host(
            self.steps,
            self.cfg,
            self.spans,
            self._cohorts(view.topology, linked),
            last,
            {e.rank for e in found} | set(self.solo),
        )
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
                not_a_straggler(e, cohort, why)
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
                not_a_straggler(e, cohort, why)
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
                not_a_straggler(e, cohort, why)
                continue
            if not e.lowest_part >= STEADY_PART_RATIO:
                why = (
                    "not slower in every window of the span after its first (one at "
                    f"{e.lowest_part:.2f}x): an episode, not a straggler"
                )
                not_a_straggler(e, cohort, why)
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
                    not_a_straggler(e, cohort, why)
                    continue
            # The arrival order over the steps it has been slow in (since its first span),
            # the longer span's at most.
            since = self._slow_since.setdefault(e.rank, e.first)
            start = self.steps.start_from_ns(e.rank, max(since, last - max(self.spans) + 1), last)
            mine = _streak_samples(joined, e.rank, t1 if start is None else start, t1)
            balance = wait_balance(e.rank, mine)
            longest = last - since + 1 >= max(self.spans)
            if host_wait is not None and longest:
                longest = held_s(self.steps, e.rank, since, last) >= HOST_MIN_HELD_S
            strong = e.z >= CLEAR_EXCESS_Z * self.cfg.excess_z
            decisive = e.z >= SOLO_EXCESS_Z * self.cfg.excess_z
            gains = self._busy_gains(e.first, e.last) if e.rank in self.solo else {}
            if e.rank in self.solo:
                why = solo_not_confirmed(e, self.cfg.excess_z, gains)
            elif host_wait is not None and not (longest or decisive):
                why = f"held back by its host {last - since + 1} steps: the longer span decides"
            else:
                why = not_waited_for(len(cohort), mine, balance.share, longest, strong)
                if why and decisive:
                    why = not_decisive(e, mine, balance, step_us.get(e.rank, 0.0))
            if why:
                not_a_straggler(e, cohort, why)
                continue
            self._straggler_told.add(e.rank)
            out.append(self._straggler_verdict(view, e, cohort, mine, balance, host_wait, gains))
        return out

    def add_to_floors(self, window: StepWindow | None, lo: int, hi: int) -> None:
        """Add the window's medians of the ranks compared by their change to their floors:
        compute, and compute with the wait for a CPU."""
        if window is None:
            return
        solo = set(self.solo)
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

    def _rounds_within(self, e: Excess) -> float:
        """How long (us) the diagnoser's rounds ran on its rank (the observer's) within
        the steps of ``e``."""
        span = self.steps.span_ns(e.rank, e.first, e.last) if self._observer_rounds else None
        if span is None:
            return 0.0
        rounds = np.array(self._observer_rounds, np.int64)
        within = np.minimum(rounds[:, 1], span[1]) - np.maximum(rounds[:, 0], span[0])
        return float(np.clip(within, 0, None).sum()) / 1000

    def _cohorts(self, topo: Topology, linked: set[int]) -> dict[int, list[int]]:
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
        new = linked - self._linked_seen
        self._linked_seen |= new
        for r in new:
            if not topo.placed(r):
                self._cohort_cache[r] = [r]
                changed = True
        if changed:
            cohorts = self._cohort_cache
            self.solo = sorted(r for r, c in cohorts.items() if len(c) == 1)
            if len(self.solo) < SOLO_MIN_RANKS:
                self.solo = []
        return self._cohort_cache

    def _straggler_verdict(
        self,
        view: JobView,
        e: Excess,
        cohort: list[int],
        mine: RankJoined,
        balance: WaitBalance,
        host_wait: HostWait | None = None,
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
        solo = r in self.solo
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
        others = others_gain(gains or {}, r)
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


def _streak_samples(joined: JoinedTable, r: int, t0: int, t1: int) -> RankJoined:
    """Rank r's joined collectives (of groups of two or more) between t0 and t1."""
    j = joined
    return j.of_rank(r, (t0 <= j.time_ns) & (j.time_ns <= t1) & (j.size > 1))


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
