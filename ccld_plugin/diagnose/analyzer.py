"""The diagnoser's rounds: one view of the job in, the new verdicts out.

Keeps what must persist across rounds (op duration history for the adaptive hang
threshold, the slow detector's windows, what was already reported) and decides which
finding explains which: a mismatch or an unresponsive rank explains the hang it causes,
so the hang is not reported on its own.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable

import numpy as np

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose.hang import (
    ChannelEvidence,
    find_hangs,
    find_mismatches,
    find_unresponsive,
)
from ccld_plugin.diagnose.isolation import isolation_hang, observer_isolated
from ccld_plugin.diagnose.nccl_evidence import nccl_evidence
from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.diagnose.slow import SlowDetector
from ccld_plugin.diagnose.tcp_evidence import Located, channel_evidence
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.wire.topology import GroupInfo

__all__ = ["Diagnoser", "located_by_channels"]

HISTORY = 300  # per-group max op durations kept (one per rank per round)
FIRST_OP_FACTOR = 2.0


def located_by_channels(view: JobView, group: GroupInfo, members: list[int]) -> Located | None:
    """Where a hang's channels put it: NCCL wait states first (they say exactly what each
    step waits for), then the TCP connections. The live diagnoser's and the post-mortem's."""
    return nccl_evidence(view, group, members) or channel_evidence(view, group, members)


class Diagnoser:
    def __init__(
        self,
        cfg: DiagnoserConfig,
        interval_s: float,
        channel_evidence: ChannelEvidence | None = None,
    ) -> None:
        self.cfg = cfg
        self.min_wait_s = 2 * interval_s
        self.channel_evidence = channel_evidence
        self.slow = SlowDetector(cfg)
        self._durations: dict[int, deque[int]] = defaultdict(lambda: deque(maxlen=HISTORY))
        self._reported: set[tuple] = set()
        self._seen_ns: dict[int, int] = {}  # per rank: time of the summary last taken in

    def threshold_s(self, group_id: int) -> float:
        """max(hang_min_s, hang_k x p99 duration of ops on the group). Before any op of the
        group has completed, twice the floor: a group's first ops also set up its
        connections, and the first step is the slowest of a job."""
        history = self._durations.get(group_id)
        if not history:
            return FIRST_OP_FACTOR * self.cfg.hang_min_s
        p99 = float(np.percentile(history, 99)) / 1e6
        return max(self.cfg.hang_min_s, self.cfg.hang_k * p99)

    def round(self, view: JobView) -> list[Verdict]:
        # Rounds run about twice per agent tick: a summary read again holds nothing new,
        # and its durations, steps and samples must be taken in once.
        fresh = [s for rank, s in view.summaries.items() if self._seen_ns.get(rank, -1) < s.time_ns]
        for s in fresh:
            self._seen_ns[s.rank] = s.time_ns
            for gp in s.groups:
                g = view.group(s.rank, gp.slot)
                if g is not None and gp.ops:
                    self._durations[g.group_id].append(gp.max_dur_us)
        self.slow.ingest(view, fresh)
        isolated = observer_isolated(view)
        if isolated is not None:
            # Every silent peer is an effect of the observer's own isolation: the peers'
            # stale summaries would name each of them, so only the observer is judged.
            v = isolation_hang(view, isolated, self.threshold_s)
            return self._new([v] if v is not None else [])
        unresponsive = find_unresponsive(view, self.cfg.unresponsive_s)
        mismatches = find_mismatches(view)
        explained = {r for v in unresponsive for r in v.ranks}
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
        return self._new([*unresponsive, *mismatches, *hangs, *slow])

    def _new(self, verdicts: list[Verdict]) -> list[Verdict]:
        """The verdicts not reported before (each is reported once)."""
        new = []
        for v in verdicts:
            if v.key() not in self._reported:
                self._reported.add(v.key())
                new.append(v)
        return new

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
