"""Communication-bound slowness over a window of steps: a group whose transfer bandwidth is
an outlier against its sibling groups of the same role (and its own history); slow groups
of different roles intersected to find the common rank; slow links in the channel
evidence (``slow_links``) or in the pipelines' messages (``pipeline_links``). A finding is
told once it held for ``confirm_windows`` windows.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Callable

import numpy as np

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose.arrivals import MIN_ARRIVAL_SAMPLES, JoinedTable
from ccld_plugin.diagnose.links.pipeline_links import PipelineLinks
from ccld_plugin.diagnose.links.slow_links import ChannelHistory, LinkFinding
from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.diagnose.robust import RankedValues
from ccld_plugin.diagnose.step_table import StepTable
from ccld_plugin.diagnose.view import GroupIndex, JobView
from ccld_plugin.errors import log
from ccld_plugin.topology import GroupInfo

__all__ = ["SlowCommunication"]

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


class SlowCommunication:
    """The communication verdicts of the slow detector's windows, and their streaks."""

    def __init__(self, cfg: DiagnoserConfig, index: GroupIndex, steps: StepTable) -> None:
        self.cfg = cfg
        self.steps = steps  # the detector's, shared: when a finding's first window began
        self.channels = ChannelHistory()  # per-peer TCP evidence: names the slow link's rank
        self.pipelines = PipelineLinks(index)  # their messages, paired
        self.streak: dict[tuple, int] = defaultdict(int)
        self.first_seen: dict[tuple, int] = {}
        self.bw_history: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=20))
        self._channel_found: LinkFinding | None = None  # of the current streak
        self._comm_reported: set[tuple] = set()  # communication streaks with a verdict

    def judge(
        self,
        view: JobView,
        window: tuple[int, int, int, int],
        joined: JoinedTable,
        stragglers: set[int],
        queued: Callable[[], frozenset[int]],
        first_steps: tuple[int, int] | None,
    ) -> list[Verdict]:
        """Communication-bound slowness over ``window`` (steps lo..hi-1, from t0 to t1):
        groups whose bandwidth over the collectives of ``joined`` falls below their
        siblings', links the channels or the pipelines' messages find slow. ``stragglers``
        (ranks slower than their cohort now) explain their groups' low bandwidth;
        ``queued``: the ranks that wait for a CPU (asked only where pipelines are judged);
        ``first_steps``: when steps 1-2 ran, in the job's first window."""
        lo, hi, t0, t1 = window
        bw, groups = _group_bandwidth(joined, t0, t1)
        by_role: dict[str, dict[int, float]] = defaultdict(dict)
        for gid, b in bw.items():
            by_role[groups[gid].role][gid] = b
        ranked = {role: RankedValues(v) for role, v in by_role.items()}
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
            found, fresh, healthy = self.pipelines.judge(
                view,
                self.channels,
                (lo, hi, t0, t1),
                judged,
                frozenset(stragglers),
                queued=queued(),
                first_steps=first_steps,
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
            return self.channel_slow(view, found, lo, hi) if fresh else []
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

    def channel_slow(self, view: JobView, found: LinkFinding, lo: int, hi: int) -> list[Verdict]:
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
