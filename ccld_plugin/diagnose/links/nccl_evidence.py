"""Hangs of NCCL collectives, located from the wait states of their channels.

The NCCL profiler plugin records, per channel, peer and direction, which state the oldest
unfinished transfer step waits in (``ccld_plugin.probes.nccl_channels`` turns the records into
"nccl" entries of the summary). Each state says whom the step waits for:

- **local**: this rank's GPU. A send step waits for the kernel to produce the data, a
  receive step for the kernel to consume data that has arrived.
- **peer** (send): the receiver's credit, i.e. a free buffer on the peer.
- **network**, send: a step handed to the transport that does not complete (the link);
  receive: data that has not arrived from the peer.

A stalled collective shows these waits on every rank, because a fault spreads along the
ring or tree: the ranks after a stuck GPU are starved (their receives wait for data, their
sends have nothing to forward), the ranks before it are held back (their sends wait for
credit). So the waits are read as a wait-for graph over ranks and links, as the hang
detector reads op arrival: rank r waits for p when its send waits for p's credit or its
receive waits for data that p has not handed to the network; r waits for the link (r, p)
when its send, or p's send to it, waits on the network. The culprit is where the chains
end: a rank that waits for nobody (its GPU, when data reached it and is not consumed; its
receive side, when peers wait for its credit and it posts no receive), or a link. Two
ranks that wait for each other (credit one way, data the other) have lost the messages
between them: their link.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from ccld_plugin.diagnose.links.tcp_evidence import STALL_S, Located, is_silent, report_of
from ccld_plugin.diagnose.records import Cause, Evidence
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.peer_channels import PeerChannel

__all__ = ["nccl_evidence", "nccl_stalls"]

Node = tuple[int, ...]  # (rank,) or (a, b) with a < b: a link


def _link(a: int, b: int) -> Node:
    return (min(a, b), max(a, b))


def nccl_stalls(view: JobView, members: Iterable[int]) -> dict[int, list[PeerChannel]]:
    """Per member, its NCCL channel entries to other members that have stopped moving."""
    ms = set(members)
    out: dict[int, list[PeerChannel]] = {}
    for rank in sorted(ms):
        rep = report_of(view, rank)
        if rep is None or is_silent(view, rank, rep.interval_s):
            continue  # a silent rank's last report predates the stall
        es = [
            e
            for e in rep.entries
            if e.source == "nccl"
            and e.peer in ms
            and e.wait != "none"
            and e.queued > 0
            and e.stalled_s >= STALL_S
        ]
        if es:
            out[rank] = es
    return out


def _sends_on_network(stalls: dict[int, list[PeerChannel]], src: int, dst: int) -> bool:
    return any(
        e.direction == "send" and e.wait == "network" and e.peer == dst for e in stalls.get(src, ())
    )


def _edges(stalls: dict[int, list[PeerChannel]]) -> dict[Node, set[Node]]:
    edges: dict[Node, set[Node]] = defaultdict(set)
    for r, es in stalls.items():
        for e in es:
            if e.wait == "peer":
                edges[(r,)].add((e.peer,))
            elif e.wait == "network" and (
                e.direction == "send" or _sends_on_network(stalls, e.peer, r)
            ):
                edges[(r,)].add(_link(r, e.peer))
            elif e.wait == "network":
                edges[(r,)].add((e.peer,))
    return edges


def _ends(edges: dict[Node, set[Node]], start: Node) -> set[Node]:
    """Where the wait chains from ``start`` end: ranks that wait for nobody, links, and
    the two ranks of a 2-cycle read as their link (longer cycles: all their ranks)."""
    ends: set[Node] = set()
    path: list[Node] = []
    seen: set[Node] = set()

    def visit(n: Node) -> None:
        if n in path:
            cycle = path[path.index(n) :]
            ranks = sorted(x[0] for x in cycle)
            ends.add(_link(*ranks) if len(ranks) == 2 else tuple(ranks))
            return
        if n in seen:
            return
        seen.add(n)
        nexts = edges.get(n) if len(n) == 1 else None
        if not nexts:
            ends.add(n)
            return
        path.append(n)
        for m in sorted(nexts):
            visit(m)
        path.pop()

    visit(start)
    return ends


# What a stalled transfer step waits for, by (wait state, direction).
_WAITS_FOR = {
    ("local", "send"): "waits for its GPU to produce the data",
    ("local", "recv"): "the data arrived; its GPU does not consume it",
    ("peer", "send"): "waits for rank {peer}'s credit (a free receive buffer)",
    ("network", "send"): "handed to the network, not completed",
    ("network", "recv"): "waits for data from rank {peer} on the network",
}


def _wait(rank: int, e: PeerChannel) -> Evidence:
    toward = "to" if e.direction == "send" else "from"
    channels = "channel" if e.conns == 1 else "channels"
    return Evidence.of(
        "nccl_wait",
        "rank {rank} {direction} " + toward + " {peer} ({conns} " + channels + ", "
        "{pending:bytes} pending): " + _WAITS_FOR[(e.wait, e.direction)] + "; "
        "no progress for {stalled_s:.1f} s",
        rank=rank,
        direction=e.direction,
        peer=e.peer,
        wait=e.wait,
        conns=e.conns,
        pending=e.queued,
        stalled_s=e.stalled_s,
    )


def nccl_evidence(view: JobView, group: GroupInfo, members: list[int]) -> Located | None:
    """For a hang in ``group`` where every member entered the op: the rank or link where
    the NCCL channels' wait chains end, with the cause their wait states show; None when
    no member's NCCL channels have stalled."""
    stalls = nccl_stalls(view, members)
    if not stalls:
        return None
    edges = _edges(stalls)
    ends = {r: _ends(edges, (r,)) for r in stalls}
    reached: Counter[Node] = Counter(n for e in ends.values() for n in e)
    top = max(reached.values())
    culprits = sorted(n for n, c in reached.items() if c == top)
    waiters = [r for r, e in ends.items() if culprits[0] in e]
    if len(culprits) == 1 and len(culprits[0]) == 1:
        (root,) = culprits[0]
        own = stalls.get(root, [])
        mine = [_wait(root, e) for e in own[:2]]
        into = [
            (r, e)
            for r, es in stalls.items()
            for e in es
            if r != root and e.peer == root and (e.wait, e.direction) != ("local", "send")
        ]
        theirs = [_wait(r, e) for r, e in into[:2]]
        count = Evidence.of(
            "waiting_on_rank",
            "{count} of {of} ranks of {role}{members} wait on rank {rank}, directly or "
            "through other ranks",
            count=len(waiters),
            of=len(members),
            role=group.role,
            members=list(group.ranks),
            rank=root,
        )
        rep = report_of(view, root)
        if rep is None or is_silent(view, root, rep.interval_s):
            return Located(
                [root],
                None,
                [
                    *theirs,
                    count,
                    Evidence.of(
                        "no_summaries",
                        "rank {rank} sends no summaries: what its own channels wait on is not "
                        "known",
                        rank=root,
                    ),
                ],
                Cause.UNKNOWN,
            )
        credit = sorted({r for r, e in into if e.wait == "peer"})
        if any(e.wait == "local" and e.direction == "recv" for e in own):
            return Located(
                [root],
                None,
                [
                    *mine,
                    *theirs,
                    count,
                    Evidence.of(
                        "gpu_not_consuming",
                        "data reached rank {rank} and its GPU does not take it: the GPU is "
                        "busy or stuck outside this collective (compute-bound)",
                        rank=root,
                    ),
                ],
                Cause.COMPUTE,
            )
        if credit:
            return Located(
                [root],
                None,
                [
                    *theirs,
                    *mine,
                    count,
                    Evidence.of(
                        "no_credit",
                        "rank {rank} grants no credit to ranks {ranks} and none of its receives "
                        "waits (it posts none): its receive side (NCCL proxy or transport) is "
                        "stuck, while its GPU only waits for input",
                        rank=root,
                        ranks=credit,
                    ),
                ],
            )
        if any(e.wait == "local" for e in own):
            return Located(
                [root],
                None,
                [
                    *mine,
                    *theirs,
                    count,
                    Evidence.of(
                        "gpu_not_producing",
                        "rank {rank}'s GPU does not produce the data its peers wait for, and "
                        "nothing is owed to it: the GPU is busy or stuck outside this "
                        "collective (compute-bound)",
                        rank=root,
                    ),
                ],
                Cause.COMPUTE,
            )
        return Located(
            [root],
            None,
            [
                *theirs,
                count,
                Evidence.of(
                    "nccl_not_started",
                    "rank {rank} shows no pending transfer step of this collective: its NCCL "
                    "work for it has not started",
                    rank=root,
                ),
            ],
            Cause.UNKNOWN,
        )
    if len(culprits) == 1 and len(culprits[0]) == 2:
        a, b = culprits[0]
        pair = [
            (r, e)
            for r in (a, b)
            for e in stalls.get(r, [])
            if e.peer in (a, b) and e.wait in ("network", "peer")
        ]
        evidence = [_wait(r, e) for r, e in pair[:3]]
        if any(e.wait == "network" and e.direction == "send" for _, e in pair):
            evidence.append(
                Evidence.of(
                    "nccl_link_down",
                    "steps handed to the network between ranks {link[0]} and {link[1]} do "
                    "not complete: the link is down or lossy",
                    link=[a, b],
                )
            )
        else:
            evidence.append(
                Evidence.of(
                    "messages_lost",
                    "ranks {link[0]} and {link[1]} wait for each other (credit one way, "
                    "data the other): the messages between them are lost on their link",
                    link=[a, b],
                )
            )
        evidence.append(
            Evidence.of(
                "waiting_on_link",
                "{count} of {of} ranks wait on this link",
                count=len(waiters),
                of=len(members),
                link=[a, b],
            )
        )
        return Located([a, b], [a, b], evidence)
    ranks = sorted({r for n in culprits for r in n})
    evidence = [_wait(r, e) for r in ranks for e in stalls.get(r, [])[:1]]
    evidence.append(
        Evidence.of(
            "several_ends",
            "the NCCL channels' waits end at several places: every one is named",
            ranks=ranks,
        )
    )
    return Located(ranks, None, evidence)
