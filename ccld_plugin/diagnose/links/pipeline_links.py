"""The pipelines' connections, judged by their messages (``p2p_transfers``) beside what the
channel evidence (``slow_links``) says of the same window.

A pipeline's one-way flows leave the channels ambiguous: a healthy link's sender waits on
delayed ACKs as long as a slow one's (TP2xPP2, one pipeline connection shaped to 30 Mbit/s:
1.9x its sibling by the channels, 24-30 ms there and back against 1-2 ms by its messages).
Its messages tell which connection is slow, not whether one end's port is: that end's
other links (its TP or DP groups') do, by the channels' port rule, judged over the windows
since the connection turned slow.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from ccld_plugin.diagnose.links.p2p_transfers import P2PJoin, Transfers
from ccld_plugin.diagnose.links.slow_links import (
    ChannelHistory,
    LinkFinding,
    LinkJudgement,
    common_rank,
)
from ccld_plugin.diagnose.links.slow_messages import (
    LoneConnection,
    described_connections,
    p2p_cleared,
    slow_p2p_port,
)
from ccld_plugin.diagnose.view import GroupIndex, JobView
from ccld_plugin.errors import log
from ccld_plugin.wire.summary_batch import SummaryTable

__all__ = ["PipelineLinks"]


class PipelineLinks:
    """The messages of the job's pipelines, paired end to end while a window may judge
    them, and what their judgement keeps from one window to the next."""

    def __init__(self, index: GroupIndex) -> None:
        self.join = P2PJoin(index)
        self.transfers = Transfers.empty()
        self.lone = LoneConnection()  # a lone pipeline's connections, their past
        self.linked: set[int] = set()  # ranks that ever sent or received a message
        # A connection among sibling pipelines slow by its messages: since when (the first
        # window of its episode, until a window shows it healthy), and its ranks.
        self._episode: tuple[int, list[int]] | None = None

    def ingest(self, view: JobView, table: SummaryTable) -> None:
        """Take in the point-to-point samples of ``table`` (summaries not seen before)."""
        paired = self.join.add(view, table)
        if len(paired.src):
            self.transfers = Transfers.concat([self.transfers, paired])
            self.linked.update(np.unique(np.concatenate([paired.src, paired.dst])).tolist())

    def forget_before(self, t_ns: int) -> None:
        self.transfers = self.transfers.since(t_ns)

    def measured(self) -> bool:
        return len(self.transfers.src) > 0

    def judge(
        self,
        view: JobView,
        channels: ChannelHistory,
        window: tuple[int, int, int, int],
        judged: LinkJudgement,
        late: frozenset[int],
        queued: frozenset[int],
        first_steps: tuple[int, int] | None = None,
    ) -> tuple[LinkFinding | None, bool, frozenset[int] | None]:
        """The channels' judgement of ``window`` (steps lo..hi-1, times t0..t1) with the
        messages': in a lone pipeline (its ranks have no other links) where the channels
        found no slow link, or could not judge this window (their finding is an older
        one); among sibling pipelines where they judged it too, as one finding. ``late``:
        ranks computing slower than their cohort; ``queued``: ranks that waited for a CPU;
        ``first_steps``: when steps 1-2 ran, given with the job's first window. Returns
        the finding, whether it is this window's, and the ranks whose links the messages
        showed healthy (None: not judged)."""
        lo, hi, t0, t1 = window
        found, fresh = judged.found, judged.fresh
        one_pipeline = self.join.one_pipeline(view, self.transfers)
        judged_too = not fresh if one_pipeline else fresh
        if found is not None and not judged_too:
            return found, fresh, None
        groups = self.join.groups
        lone = self.lone if one_pipeline else None
        if lone and first_steps:
            lone.remember(self.transfers, *first_steps, late)
        p2p = slow_p2p_port(self.transfers, groups, t0, t1, late, lone, queued=queued)
        healthy = None
        if p2p is None:
            # A window that lost the samples of some links (a fast job's windows take
            # turns at them; an agent's summary came late) clears only the ranks whose
            # links it measured healthy: other findings' streaks hold.
            healthy = p2p_cleared(self.transfers, groups, t0, t1, one_pipeline)
            if self._episode and set(self._episode[1]) <= healthy:
                self._episode = None
        elif found is not None and fresh:
            found = _common_port(found, p2p)
        else:
            if p2p.link is not None and not one_pipeline:
                if self._episode is None or self._episode[1] != p2p.link:
                    self._episode = (t0, p2p.link)
                p2p = _port_end(view, channels, p2p, self._episode[0], t1)
            found, fresh = p2p, True
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "ccld window %d-%d: pipeline connections %s: %s",
                lo,
                hi - 1,
                described_connections(self.transfers, t0, t1),
                f"slow {p2p.ranks} (link {p2p.link})"
                if p2p is not None
                else f"none slow, ranks {sorted(healthy or ())} cleared",
            )
        return found, fresh, healthy


def _port_end(
    view: JobView, channels: ChannelHistory, found: LinkFinding, t0: int, t1: int
) -> LinkFinding:
    """A connection among sibling pipelines ``found`` slow by its messages since ``t0``:
    that link, or the port of the end whose other links are slow too by the channels; not
    settled while they cannot tell yet."""
    assert found.link is not None
    ends = channels.port_end(view, found.link, t0, t1)
    if ends is None:
        return replace(found, settled=False)
    rank, lines = ends
    evidence = [*found.evidence, *lines]
    if rank is None:
        return replace(found, evidence=evidence)
    return LinkFinding([rank], None, found.group, found.severity, evidence)


def _common_port(channels: LinkFinding, messages: LinkFinding) -> LinkFinding:
    """One window's slow links by the channels and by the pipelines' messages, as one
    finding: where one names a rank and the other a link through it, that rank; where
    they name two links with one rank in common (the channels a TP link, the messages its
    end's pipeline connection), that rank's port; otherwise the channels' finding."""
    a, b = set(channels.ranks), set(messages.ranks)
    if a == b or len(a & b) != 1:
        return channels
    severity = min(channels.severity, messages.severity)
    # (the channels' "one link is slow" is not so: the messages show another)
    evidence = [e for e in [*channels.evidence, *messages.evidence] if e.fact != "one_link"]
    if len(a) > 1:  # (a port the channels named says why already)
        evidence.append(common_rank(min(a & b)))
    return LinkFinding(sorted(a & b), None, channels.group, severity, evidence)
