"""The analyzer's round: one view of the job in, the new verdicts out.

Keeps what must persist across rounds (op duration history for the adaptive hang
threshold, the slow detector's windows, what was already reported) and decides which
finding explains which: a mismatch or an unresponsive rank explains the hang it causes,
so the hang is not reported on its own; a reported stall (hang, deadlock, mismatch)
explains the ranks that vanish after it while stuck in it (the job's timeouts, the
scheduler's kill), so they are not reported as unresponsive.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose.links import tcp_evidence as chan
from ccld_plugin.diagnose.links.nccl_evidence import nccl_evidence
from ccld_plugin.diagnose.links.tcp_evidence import Located, channel_evidence
from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.diagnose.slow import SlowDetector
from ccld_plugin.diagnose.stalls.crash import find_crashes
from ccld_plugin.diagnose.stalls.hang import ChannelEvidence, find_hangs, find_unresponsive, resumed
from ccld_plugin.diagnose.stalls.isolation import (
    Isolation,
    cut_off_behind_store,
    isolation_hang,
    observer_isolated,
)
from ccld_plugin.diagnose.stalls.mismatch import find_left_early, find_mismatches
from ccld_plugin.diagnose.view import GroupIndex, JobView
from ccld_plugin.topology import GroupInfo, trace_id
from ccld_plugin.wire.codes import STATE_IN_FLIGHT
from ccld_plugin.wire.summary_batch import Summaries, SummaryTable

__all__ = ["Analyzer", "DurationHistory", "located_by_channels"]

HISTORY = 300  # per-group max op durations kept (one per rank per round)
STALLS = (Kind.HANG, Kind.DEADLOCK, Kind.MISMATCH)
FIRST_OP_FACTOR = 2.0


def located_by_channels(view: JobView, group: GroupInfo, members: list[int]) -> Located | None:
    """Where a hang's channels put it: NCCL wait states first (they say exactly what each
    step waits for), then the TCP connections. The live diagnoser's and the post-mortem's."""
    return nccl_evidence(view, group, members) or channel_evidence(view, group, members)


class Analyzer:
    def __init__(
        self,
        cfg: DiagnoserConfig,
        interval_s: float,
        channel_evidence: ChannelEvidence | None = None,
    ) -> None:
        self.cfg = cfg
        self.min_wait_s = 2 * interval_s
        self.channel_evidence = channel_evidence
        # one index of the job's groups, built once per topology, for both
        groups = GroupIndex()
        self.slow = SlowDetector(cfg, groups)
        self.durations = DurationHistory(groups)
        self._reported: set[tuple] = set()
        # hangs reported and not seen to end: key -> (verdict, when it was reported)
        self._open_hangs: dict[tuple, tuple[Verdict, int]] = {}
        self._seen_ns = np.full(0, -1, np.int64)  # per rank: time of the summary last taken in
        # when the first stall was reported (None: none yet), and the ranks stalls named
        self._stalled_ns: int | None = None
        self._isolation: Isolation | None = None  # the observer's, once seen
        self._stalled_ranks: set[int] = set()
        self._crashed_ns: int | None = None  # when the first crash seen happened
        # whether the job marks its steps (a loop with no optimizer and no mark_step stays
        # at step 0: its verdicts then name no step)
        self._steps_marked = False

    def threshold_s(self, group_id: int) -> float:
        """max(hang_min_s, hang_k x p99 duration of ops on the group). Before any op of the
        group has completed, twice the floor: a group's first ops also set up its
        connections, and the first step is the slowest of a job."""
        history = self.durations.of(group_id)
        if not len(history):
            return FIRST_OP_FACTOR * self.cfg.hang_min_s
        p99 = float(np.percentile(history, 99)) / 1e6
        return max(self.cfg.hang_min_s, self.cfg.hang_k * p99)

    def round(self, view: JobView) -> list[Verdict]:
        fresh = self._fresh(view)
        self.durations.add(view, fresh.table)
        self.slow.ingest(view, fresh)
        interval = chan.interval_s(view)
        isolated = None
        all_silent = _all_peers_silent(view, interval)
        if all_silent:
            isolated = observer_isolated(view)
            # (a peer's host that answers the observer's handshake ends it: its link works)
            reached = any(view.reach.values())
            if (
                isolated is None
                and (view.store_local or view.store_failed is not None)
                and not reached
            ):
                # Once seen, the isolation explains the peers' silence until one speaks
                # again: its own signs (a stalled link's retransmissions) come and go.
                isolated = self._isolation
        self._isolation = isolated
        if isolated is not None:
            # Every silent peer is an effect of the observer's own isolation: the peers'
            # stale summaries would name each of them, so only the observer is judged.
            v = isolation_hang(view, isolated, self.threshold_s)
            return self._new([v] if v is not None else [])
        if all_silent and view.store_failed is not None:
            # The observer hears nobody through a store that does not answer it, and it
            # is not isolated itself: the peers' silence is the store's, and says nothing
            # of them; only its handshakes single out ranks that are cut off.
            return self._new(cut_off_behind_store(view))
        crashes = find_crashes(view, self.min_wait_s)
        crashed = {r for v in crashes for r in v.ranks}
        if crashed:
            first = min(view.summaries[r].time_ns for r in crashed)
            self._crashed_ns = min(first, self._crashed_ns or first)
        lost = find_unresponsive(view, self.cfg.unresponsive_s)
        unresponsive = [
            v
            for v in lost
            if not self._fallout_of_stall(view, v.ranks[0])
            and not self._fallout_of_crash(view, v.ranks[0])
        ]
        # A crashed rank's last op differs from its peers' when that op is what raised
        # (a collective called with bad arguments): the crash says why; not a mismatch.
        mismatches = [
            v
            for v in (
                *find_mismatches(view, self.threshold_s, self.slow.joined.sizes_of),
                *find_left_early(view, self.min_wait_s),
            )
            if not crashed & set(v.ranks)
        ]
        if mismatches and unresponsive:
            unresponsive = _fold_deaths_into_mismatch(view, unresponsive, mismatches)
        # A rank found lost, or seen dead whose verdict waits a tick for its node's word on
        # it (hang._last_words_due): a group it is in stalls because of it.
        explained = {r for v in lost for r in v.ranks} | view.gone | crashed
        explained_groups = {v.group["group_id"] for v in mismatches if v.group}
        hangs = [
            v
            for v in find_hangs(view, self.threshold_s, self.min_wait_s, self.channel_evidence)
            if v.group is None
            or (
                v.group["group_id"] not in explained_groups
                and not explained & set(v.group["ranks"])
            )
        ]
        if mismatches or self.reported(Kind.MISMATCH):
            hangs = self._fold_into_mismatch(hangs, mismatches)
        slow = self.slow.evaluate(view) if not hangs else []
        new = [
            *self._resumed(view),
            *self._new([*crashes, *unresponsive, *mismatches, *hangs, *slow]),
        ]
        self._steps_marked = self._steps_marked or view.steps_marked
        if not self._steps_marked:
            for v in new:
                v.step = None
        for v in new:
            if v.kind in STALLS:
                if self._stalled_ns is None:
                    self._stalled_ns = view.now_ns
                self._stalled_ranks.update(v.ranks)
            if v.kind is Kind.HANG:
                self._open_hangs[v.key()] = (v, view.now_ns)
        return new

    def _resumed(self, view: JobView) -> list[Verdict]:
        """Hangs reported before whose ranks have all made progress since (a rank that
        stopped 14 s for a checkpoint of its own): each is told as ended, and a stall of the
        same ranks later is a new finding, reported again."""
        out = []
        for key, (hang, reported_ns) in list(self._open_hangs.items()):
            # (a rank that went on and then left, or died, went on all the same)
            summaries = [s for s in map(view.summaries.get, hang.ranks) if s is not None]
            if len(summaries) < len(hang.ranks):
                continue
            if any(s.last_progress_ns <= reported_ns for s in summaries):
                continue
            del self._open_hangs[key]
            self._reported.discard(key)
            out.append(resumed(view, hang, summaries, reported_ns))
        if out and not any(k[0] in STALLS for k in self._reported):
            self._stalled_ns, self._stalled_ranks = None, set()  # nothing stalls now
        return out

    def _fallout_of_crash(self, view: JobView, rank: int) -> bool:
        """Whether ``rank``, found gone or silent, still ran when a rank crashed (its last
        heartbeat at most two agent ticks older than the crash): a launcher ends the
        others once one rank fails (torchrun: SIGTERM), and that is the crash's doing."""
        if self._crashed_ns is None:
            return False
        ticks_ns = self.min_wait_s * 1e9  # two agent intervals
        return view.summaries[rank].heartbeat_ns >= self._crashed_ns - ticks_ns

    def _fallout_of_stall(self, view: JobView, rank: int) -> bool:
        """Whether ``rank``, found gone or silent, went down with a stall reported before:
        one the stall named, or one stuck since before it was reported (its oldest op in
        flight entered earlier). Its end is the stall's consequence, not news."""
        if self._stalled_ns is None:
            return False
        if rank in self._stalled_ranks:
            return True
        s = view.summaries[rank]
        return any(
            op.state == STATE_IN_FLIGHT and op.enter_ns < self._stalled_ns for op in s.in_flight
        )

    def _fresh(self, view: JobView) -> Summaries:
        """The summaries of ``view`` not taken in before (a round runs about twice per
        agent tick: a summary read again holds nothing new)."""
        t = view.columns
        ranks, times = t.ranks, t.heads["time_ns"]
        top = int(ranks.max(initial=-1)) + 1
        if top > len(self._seen_ns):
            grown = np.full(top, -1, np.int64)
            grown[: len(self._seen_ns)] = self._seen_ns
            self._seen_ns = grown
        new = self._seen_ns[ranks] < times
        self._seen_ns[ranks[new]] = times[new]
        return Summaries(t if new.all() else t.select(new))

    def _new(self, verdicts: list[Verdict]) -> list[Verdict]:
        """The verdicts not reported before (each is reported once)."""
        new = []
        for v in verdicts:
            if v.key() not in self._reported and not self._hang_read_again(v):
                self._reported.add(v.key())
                new.append(v)
        return new

    def _hang_read_again(self, v: Verdict) -> bool:
        """Whether ``v`` is a hang reported before with another cause: the same stall read
        again as its evidence changes (the culprit's channel records clear when its op
        ends, its summaries stop when it leaves). Only a first cause found where the one
        reported was unknown is news."""
        if v.kind is not Kind.HANG:
            return False
        _, cause, ranks, group = v.key()
        causes = {k[1] for k in self._reported if k[0] == Kind.HANG and k[2:] == (ranks, group)}
        return bool(causes) and (cause is Cause.UNKNOWN or causes != {Cause.UNKNOWN})

    @staticmethod
    def _fold_into_mismatch(hangs: list[Verdict], mismatches: list[Verdict]) -> list[Verdict]:
        """Once members of a group have issued different collectives, the job's other
        groups stall behind it. Communication hangs that no channel evidence located (all
        members named) are its effects: listed under a fresh mismatch, not reported on
        their own. Located hangs and compute hangs stand."""
        effects = [
            v
            for v in hangs
            if v.cause == Cause.COMMUNICATION
            and v.link is None
            and v.group is not None
            and sorted(v.ranks) == sorted(v.group["ranks"])
        ]
        for m in mismatches[:1]:
            # Each effect is shown by its hang's first item (all_entered), nested whole
            # under "item" as its record: the stalled group's data stays readable as data.
            m.evidence += [
                Evidence.of(
                    "stalled_behind",
                    "stalled behind it: {item[text]}",
                    item=v.evidence[0].to_dict(),
                )
                for v in effects[:4]
            ]
            if len(effects) > 4:
                m.evidence.append(
                    Evidence.of(
                        "more_stalled",
                        "... and {count} more stalled groups",
                        count=len(effects) - 4,
                    )
                )
        return [v for v in hangs if v not in effects]

    def mark_reported(self, keys: Iterable[tuple]) -> None:
        """Findings reported already (by the diagnoser this one takes over from)."""
        self._reported.update(keys)

    def reported(self, kind: Kind) -> bool:
        return any(k[0] == kind for k in self._reported)


class DurationHistory:
    """Per group: the longest op durations of the last HISTORY summaries that completed
    ops on it, as one ring of HISTORY values per group (the hang threshold reads their
    99th percentile, which does not depend on their order)."""

    def __init__(self, index: GroupIndex | None = None) -> None:
        self.index = index or GroupIndex()
        self._rings: dict[int, int] = {}  # group id -> its ring
        self._ring_of = np.zeros(0, np.int64)  # index.groups -> its ring
        self._values = np.zeros((0, HISTORY), np.int64)
        self._next = np.zeros(0, np.int64)  # per ring: where its next value goes
        self._filled = np.zeros(0, np.int64)

    def of(self, group_id: int) -> np.ndarray:
        i = self._rings.get(group_id)
        return self._values[:0, 0] if i is None else self._values[i, : self._filled[i]]

    def add(self, view: JobView, table: SummaryTable) -> None:
        """Take in the longest durations of the groups with completed ops in ``table``."""
        g = table.groups
        rows, slots, longest = g["row"], g["slot"], g["max_dur_us"]
        done = g["ops"] > 0
        if not done.all():
            rows, slots, longest = rows[done], slots[done], longest[done]
        group = self.index.lookup(view, table.ranks[rows], slots)
        known = group >= 0
        if known.any():
            new = [self._ring(gi.group_id) for gi in self.index.groups[len(self._ring_of) :]]
            self._ring_of = np.concatenate([self._ring_of, np.array(new, np.int64)])
            self._append(self._ring_of[group[known]], longest[known])

    def extend(self, group_id: int, values: list[int]) -> None:
        """Take in durations of one group, oldest first."""
        ring = self._ring(group_id)
        self._append(np.full(len(values), ring, np.int64), np.array(values, np.int64))

    def _ring(self, group_id: int) -> int:
        i = self._rings.get(group_id)
        if i is None:
            i = self._rings[group_id] = len(self._rings)
            if i >= len(self._filled):
                grow = max(64, len(self._filled))
                self._values = np.concatenate([self._values, np.zeros((grow, HISTORY), np.int64)])
                self._next = np.concatenate([self._next, np.zeros(grow, np.int64)])
                self._filled = np.concatenate([self._filled, np.zeros(grow, np.int64)])
        return i

    def _append(self, ring: np.ndarray, values: np.ndarray) -> None:
        """Append ``values`` to their rings, in order (a ring keeps its last HISTORY)."""
        order = np.argsort(ring, kind="stable")
        ring, values = ring[order], values[order]
        count = np.bincount(ring, minlength=len(self._filled))
        before = np.cumsum(count) - count
        pos = np.arange(len(ring)) - before[ring]
        taken = np.minimum(count, HISTORY)
        skip = count - taken  # of more than HISTORY at once, the last HISTORY stay
        last = pos >= skip[ring]
        ring, values, pos = ring[last], values[last], pos[last] - skip[ring[last]]
        self._values[ring, (self._next[ring] + pos) % HISTORY] = values
        self._next = (self._next + taken) % HISTORY
        self._filled = np.minimum(HISTORY, self._filled + count)


def _all_peers_silent(view: JobView, interval_s: float) -> bool:
    """Whether no rank but the observer speaks (every other one is silent or exited): what
    ``observer_isolated`` needs to find anything."""
    return view.observer is not None and not chan.speaking(view, {view.observer}, interval_s)


def _fold_deaths_into_mismatch(
    view: JobView, lost: list[Verdict], mismatches: list[Verdict]
) -> list[Verdict]:
    """A rank whose process ended inside a mismatched collective (gloo aborts the process
    on a size mismatch) died of the mismatch: said under it, not as a finding of its own."""
    by_trace = {m.trace_id: m for m in mismatches}
    kept = []
    for v in lost:
        rank = v.ranks[0]
        traces = [trace_id(g.group_id, op.seq) for op, g in view.ops_of(rank)]
        m = next((by_trace[t] for t in traces if t in by_trace), None)
        if m is None:
            kept.append(v)
            continue
        m.evidence.append(
            Evidence.of("ended_in_it", "rank {rank}'s process ended inside it", rank=rank)
        )
    return kept
