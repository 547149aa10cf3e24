"""The numbers behind the W&B panels, computed from what the diagnoser already has: each
round's :class:`JobView` and the slow detector's joined collectives (the wait / transfer
decomposition). No wandb and no I/O here, so every panel value can be tested on synthetic
views.

A rank reports each finished step once (in the summary after it ends), and the same
summary may be read in two rounds; :class:`PanelMetrics` de-duplicates, keeps a bounded
history, and hands out a :class:`StepRow` per step once every reporting rank has finished
it. Step rows are the per-step panels; :func:`hang_watch` is per round, because during a
hang there are no new steps to put it on.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ccld_plugin.diagnose.arrivals import Joined
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo, Topology
from ccld_plugin.wire.summary import StepStat

__all__ = [
    "GroupRate",
    "HangWatch",
    "PanelMetrics",
    "RankRow",
    "StepRow",
    "cohort_ratio",
    "group_key",
    "group_label",
    "hang_watch",
]

KEEP_STEPS = 256  # steps of history: the heatmap's columns and the per-rank window
MAX_PENDING_SAMPLES = 20_000
PENDING_TTL_NS = 120_000_000_000  # a sample whose step never shows up is dropped
TRIM_RAGGED = 5  # heatmap: trailing steps not yet reported by every rank, dropped


def group_label(g: GroupInfo) -> str:
    """Readable name of a group for legends and tables: ``dp[0,2,4,6]``."""
    ranks = list(g.ranks)
    shown = (
        ",".join(map(str, ranks))
        if len(ranks) <= 8
        else f"{ranks[0]},{ranks[1]},..,{ranks[-1]} ({len(ranks)})"
    )
    return f"{g.role}[{shown}]"


def group_key(g: GroupInfo) -> str:
    """A metric-name-safe name of a group (letters, digits, underscores): the groups of one
    role partition the ranks, so role, first and last rank tell them apart."""
    return f"{g.role}_{g.ranks[0]}_{g.ranks[-1]}" if g.ranks else f"{g.role}_{g.group_id:x}"


@dataclass(frozen=True)
class GroupRate:
    """Transfer bandwidth of one group over some stretch: bytes moved per second of
    transfer time (the part of a collective after the last member arrived)."""

    group: GroupInfo
    bytes: int
    transfer_ns: int
    samples: int

    @property
    def mb_s(self) -> float:
        return self.bytes / self.transfer_ns * 1e3 if self.transfer_ns > 0 else 0.0


def _rates(samples: Iterable[Joined]) -> dict[int, GroupRate]:
    acc: dict[int, list] = {}
    for j in samples:
        if j.bytes <= 0 or j.transfer_ns <= 0 or j.group.size < 2:
            continue
        a = acc.setdefault(j.group.group_id, [j.group, 0, 0, 0])
        a[1] += j.bytes
        a[2] += j.transfer_ns
        a[3] += 1
    return {gid: GroupRate(*a) for gid, a in acc.items()}


def cohort_ratio(topo: Topology, rank: int, values: dict[int, float]) -> float | None:
    """``values[rank]`` over the median of its cohort's (its DP peers, the ranks that run
    the same shard). A rank alone in its cohort is compared with every other rank."""
    peers = [values[c] for c in topo.cohort(rank) if c != rank and c in values]
    if not peers:
        peers = [v for r, v in values.items() if r != rank]
    med = statistics.median(peers) if peers else 0.0
    return values[rank] / med if med > 0 else None


@dataclass(frozen=True)
class StepRow:
    """One training step across the job."""

    step: int
    time_s: float  # when the step began (earliest rank), seconds since job start
    ranks: int  # ranks that reported the step
    step_ms: float  # median over ranks
    step_max_ms: float
    compute_ms: float  # median over ranks of step time minus time inside collectives
    compute_max_ms: float
    blocked_ms: dict[str, float]  # per group role: mean per rank of time inside its ops
    skew_ms: float | None  # worst arrival skew (first to last arriver) of a sampled op
    skew_role: str | None
    skew_last_rank: int | None  # who arrived last in that op
    slowest_rank: int
    slowest_ratio: float | None  # its compute time over its cohort's median
    bandwidth: dict[int, GroupRate] = field(default_factory=dict)

    def as_log(self) -> dict[str, float | int]:
        """The row as W&B keys (section ``ccld/per_step``, x-axis ``ccld/step``)."""
        p = "ccld/per_step/"
        out: dict[str, float | int] = {
            "ccld/step": self.step,
            "ccld/time_s": self.time_s,
            p + "ranks": self.ranks,
            p + "step_ms": self.step_ms,
            p + "step_max_ms": self.step_max_ms,
            p + "compute_ms": self.compute_ms,
            p + "compute_max_ms": self.compute_max_ms,
            p + "slowest_rank": self.slowest_rank,
        }
        if self.slowest_ratio is not None:
            out[p + "slowest_ratio"] = round(self.slowest_ratio, 3)
        for role, ms in sorted(self.blocked_ms.items()):
            out[f"{p}blocked_{role}_ms"] = ms
        if self.skew_ms is not None:
            out[p + "skew_ms"] = self.skew_ms
            if self.skew_last_rank is not None:
                out[p + "skew_last_rank"] = self.skew_last_rank
        return out


@dataclass(frozen=True)
class HangWatch:
    """The oldest op still in flight, against the hang threshold of its group."""

    time_s: float
    oldest_age_s: float  # 0 when nothing is in flight
    oldest_rank: int | None
    role: str | None
    op: str | None
    threshold_s: float | None
    blocked_ranks: int
    idle_max_s: float  # longest time any rank has gone without progress

    def as_log(self) -> dict[str, float | int]:
        p = "ccld/hang/"
        out: dict[str, float | int] = {
            "ccld/time_s": self.time_s,
            p + "oldest_op_age_s": round(self.oldest_age_s, 3),
            p + "blocked_ranks": self.blocked_ranks,
            p + "idle_max_s": round(self.idle_max_s, 3),
        }
        if self.oldest_rank is not None:
            out[p + "oldest_rank"] = self.oldest_rank
        if self.threshold_s is not None:
            out[p + "threshold_s"] = round(self.threshold_s, 3)
        return out


def hang_watch(view: JobView, threshold_s: Callable[[int], float] | None = None) -> HangWatch:
    blocked = view.blocked()
    idle = max((view.idle_s(r) for r in view.summaries), default=0.0)
    if not blocked:
        return HangWatch(view.seconds(view.now_ns), 0.0, None, None, None, None, 0, idle)
    b = max(blocked.values(), key=lambda x: x.age_s)
    thr = threshold_s(b.group.group_id) if threshold_s is not None else None
    return HangWatch(
        view.seconds(view.now_ns), b.age_s, b.rank, b.group.role, b.op_name, thr, len(blocked), idle
    )


@dataclass(frozen=True)
class RankRow:
    """One rank over the last window of steps (the per-rank table and bar chart)."""

    rank: int
    host: str
    steps: int
    compute_ms: float  # median per step
    blocked_ms: float  # median per step: time inside collectives
    cpu_wait_ms: float  # median per step: outside them, queued for a CPU (its host's)
    wait_ms: float  # mean per sampled collective: how long it waited for the last arriver
    last_share: float  # share of its sampled collectives it arrived last to
    ratio: float | None  # compute over its cohort's median
    bandwidth: dict[str, float]  # role -> MB/s of its group of that role

    def as_row(self, roles: list[str]) -> list:
        return [
            self.rank,
            self.host,
            self.steps,
            round(self.compute_ms, 3),
            round(self.blocked_ms, 3),
            round(self.cpu_wait_ms, 3),
            round(self.wait_ms, 3),
            round(self.last_share, 3),
            None if self.ratio is None else round(self.ratio, 3),
            *[round(self.bandwidth[r], 2) if r in self.bandwidth else None for r in roles],
        ]

    @staticmethod
    def columns(roles: list[str]) -> list[str]:
        return [
            "rank",
            "host",
            "steps",
            "compute_ms",
            "blocked_ms",
            "cpu_wait_ms",
            "wait_ms",
            "last_share",
            "cohort_ratio",
            *[f"bw_{r}_MBps" for r in roles],
        ]


class PanelMetrics:
    """Per-step and per-rank numbers accumulated over rounds."""

    def __init__(self, keep_steps: int = KEEP_STEPS) -> None:
        self.keep_steps = keep_steps
        self.steps: dict[int, dict[int, StepStat]] = defaultdict(dict)  # step -> rank -> stat
        self.blocked: dict[int, dict[int, dict[str, float]]] = defaultdict(dict)  # step->rank
        self.samples: dict[int, list[Joined]] = defaultdict(list)  # step -> joined samples
        self.hosts: dict[int, str] = {}
        self.topology = Topology()
        self._seen_ns: dict[int, int] = {}  # rank -> time of the last summary taken
        self._acc_blocked: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._max_step: dict[int, int] = {}
        self._waiting_for: set[int] = set()  # ranks of the job, less those gone
        self._starts: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # (start,end,s)
        self._pending: deque[Joined] = deque(maxlen=MAX_PENDING_SAMPLES)
        self.next_step: int | None = None  # lowest step not yet handed out
        self.rows: deque[StepRow] = deque(maxlen=keep_steps)
        self.job_start_ns = 0

    # ------------------------------------------------------------------ ingest
    def update(self, view: JobView, joined: Iterable[Joined]) -> list[StepRow]:
        """Take one round; returns the steps that every reporting rank has now finished."""
        self.job_start_ns = view.job_start_ns
        self._waiting_for = set(range(view.world)) - view.gone
        for g in view.topology.groups.values():
            self.topology.add(g)
        for rank, s in view.summaries.items():
            if self._seen_ns.get(rank) == s.time_ns:
                continue  # the same summary, read again
            self._seen_ns[rank] = s.time_ns
            self.hosts[rank] = s.host
            acc = self._acc_blocked[rank]
            for gp in s.groups:
                info = view.group(rank, gp.slot)
                if info is not None and gp.blocked_us:
                    acc[info.role] += gp.blocked_us
            fresh = [
                st for st in s.steps if st.step not in self.steps or rank not in self.steps[st.step]
            ]
            for st in fresh:
                self.steps[st.step][rank] = st
                self._max_step[rank] = max(self._max_step.get(rank, st.step), st.step)
                bisect.insort(
                    self._starts[rank], (st.start_ns, st.start_ns + st.step_us * 1000, st.step)
                )
            if fresh:
                # Time inside a role's ops is reported per summary interval; share what
                # built up since the last finished step evenly among the steps it covers.
                share = {role: us / len(fresh) / 1000 for role, us in acc.items()}
                for st in fresh:
                    self.blocked[st.step][rank] = share
                acc.clear()
            if self.next_step is None and s.steps:
                self.next_step = min(st.step for st in s.steps)
        self._pending.extend(joined)
        self._attribute(view.now_ns)
        rows = self._ready(final=False)
        self._trim()
        return rows

    def _step_of(self, rank: int, t_ns: int) -> int | None:
        starts = self._starts.get(rank)
        if not starts:
            return None
        i = bisect.bisect_right(starts, (t_ns, float("inf"), 0)) - 1
        if i >= 0 and starts[i][0] <= t_ns < starts[i][1]:
            return starts[i][2]
        return None

    def _attribute(self, now_ns: int) -> None:
        """Put each joined sample into the step its last arriver was in."""
        keep: deque[Joined] = deque(maxlen=MAX_PENDING_SAMPLES)
        for j in self._pending:
            step = self._step_of(j.last, j.time_ns)
            if step is not None:
                if self.next_step is None or step >= self.next_step:
                    self.samples[step].append(j)
            elif now_ns - j.time_ns < PENDING_TTL_NS:
                keep.append(j)
        self._pending = keep

    def _ready(self, final: bool) -> list[StepRow]:
        if self.next_step is None or not self._max_step:
            return []
        # A step is done when every live rank finished it, not only those whose steps came
        # in first: a rank whose agent is a round late would be missing from the row.
        ranks = self._waiting_for or self._max_step.keys()
        last_common = min(self._max_step.get(r, -1) for r in ranks)
        last_any = max(self._max_step.values())
        limit = last_any if final else last_common
        rows = []
        # Known steps only: step numbers need not be contiguous (a sample counter).
        for step in sorted(
            s for s, stats in self.steps.items() if self.next_step <= s <= limit and stats
        ):
            row = self._row(step)
            self.rows.append(row)
            rows.append(row)
        self.next_step = max(self.next_step, limit + 1)
        return rows

    def flush(self) -> list[StepRow]:
        """Hand out every step that any rank finished (the job is ending)."""
        return self._ready(final=True)

    def _trim(self) -> None:
        if not self.steps:
            return
        horizon = max(self.steps) - self.keep_steps
        for table in (self.steps, self.blocked, self.samples):
            for s in [s for s in table if s < horizon]:
                del table[s]
        for starts in self._starts.values():
            while starts and starts[0][2] < horizon:
                starts.pop(0)

    # ------------------------------------------------------------------ panels
    def _row(self, step: int) -> StepRow:
        stats = self.steps[step]
        compute = {r: st.compute_us / 1000 for r, st in stats.items()}
        step_ms = [st.step_us / 1000 for st in stats.values()]
        blocked: dict[str, list[float]] = defaultdict(list)
        for per_role in self.blocked.get(step, {}).values():
            for role, ms in per_role.items():
                blocked[role].append(ms)
        n = len(stats)
        worst = max(
            self.samples.get(step, ()), key=lambda j: max(j.waits_ns.values()), default=None
        )
        slowest = max(compute, key=lambda r: (compute[r], -r))
        return StepRow(
            step=step,
            time_s=round((min(st.start_ns for st in stats.values()) - self.job_start_ns) / 1e9, 3),
            ranks=n,
            step_ms=statistics.median(step_ms),
            step_max_ms=max(step_ms),
            compute_ms=statistics.median(compute.values()),
            compute_max_ms=max(compute.values()),
            blocked_ms={role: round(sum(v) / n, 3) for role, v in blocked.items()},
            skew_ms=round(max(worst.waits_ns.values()) / 1e6, 3) if worst else None,
            skew_role=worst.group.role if worst else None,
            skew_last_rank=worst.last if worst else None,
            slowest_rank=slowest,
            slowest_ratio=cohort_ratio(self.topology, slowest, compute),
            bandwidth=_rates(self.samples.get(step, ())),
        )

    def rank_rows(self, last_steps: int) -> list[RankRow]:
        """Each rank over the last ``last_steps`` finished steps."""
        if not self.steps:
            return []
        hi = max(self.steps)
        window = [s for s in self.steps if s > hi - last_steps]
        per_rank: dict[int, list[StepStat]] = defaultdict(list)
        for s in window:
            for r, st in self.steps[s].items():
                per_rank[r].append(st)
        samples = [j for s in window for j in self.samples.get(s, ())]
        waits: dict[int, list[int]] = defaultdict(list)
        lasts: dict[int, int] = defaultdict(int)
        for j in samples:
            for r, w in j.waits_ns.items():
                waits[r].append(w)
            lasts[j.last] += 1
        rates = _rates(samples)
        compute = {
            r: statistics.median(st.compute_us / 1000 for st in sts) for r, sts in per_rank.items()
        }
        rows = []
        for r in sorted(per_rank):
            sts = per_rank[r]
            bw: dict[str, float] = {}
            for rate in rates.values():
                if r in rate.group.ranks:
                    # A rank in several groups of one role: show its slowest.
                    bw[rate.group.role] = min(bw.get(rate.group.role, rate.mb_s), rate.mb_s)
            rows.append(
                RankRow(
                    rank=r,
                    host=self.hosts.get(r, ""),
                    steps=len(sts),
                    compute_ms=compute[r],
                    blocked_ms=statistics.median(
                        (st.step_us - st.compute_us - st.cpu_wait_us) / 1000 for st in sts
                    ),
                    cpu_wait_ms=statistics.median(st.cpu_wait_us / 1000 for st in sts),
                    wait_ms=statistics.fmean(waits[r]) / 1e6 if waits[r] else 0.0,
                    last_share=lasts[r] / len(waits[r]) if waits[r] else 0.0,
                    ratio=cohort_ratio(self.topology, r, compute),
                    bandwidth=bw,
                )
            )
        return rows

    def bandwidth_history(self) -> dict[int, tuple[GroupInfo, list[int], list[float]]]:
        """Per group: the steps with a bandwidth sample and the MB/s in each."""
        out: dict[int, tuple[GroupInfo, list[int], list[float]]] = {}
        for row in self.rows:
            for gid, rate in row.bandwidth.items():
                g, xs, ys = out.setdefault(gid, (rate.group, [], []))
                xs.append(row.step)
                ys.append(round(rate.mb_s, 3))
        return out

    def compute_matrix(self, last_steps: int) -> tuple[np.ndarray, list[int], list[int]]:
        """Compute time (ms) as a ranks x steps matrix over the last ``last_steps`` steps,
        NaN where a rank did not report a step; with the row ranks and column steps."""
        if not self.steps:
            return np.zeros((0, 0)), [], []
        cols = sorted(self.steps)
        # The last steps of a job may not have been reported by every rank yet when the
        # diagnoser's last round runs: a ragged edge of missing cells, not data.
        full = max(len(self.steps[s]) for s in cols[-last_steps:])
        for _ in range(TRIM_RAGGED):
            if len(cols) > 1 and len(self.steps[cols[-1]]) < full:
                cols.pop()
        cols = cols[-last_steps:]
        ranks = sorted({r for s in cols for r in self.steps[s]})
        m = np.full((len(ranks), len(cols)), np.nan)
        index = {r: i for i, r in enumerate(ranks)}
        for j, s in enumerate(cols):
            for r, st in self.steps[s].items():
                m[index[r], j] = st.compute_us / 1000
        return m, ranks, cols
