"""Hangs: find the stuck ops, walk the wait-for graph to its roots, and say why.

1. In a stuck group at seq s, members that have not entered s are *missing*.
2. A missing member that is itself blocked in another op points onward; one blocked in
   nothing is a root: a compute-bound hang (stuck in compute, data loading or host code).
3. If nobody is missing, data does not flow: a communication-bound hang in that group,
   localized further by channel evidence when there is some.
4. A cycle of ranks each waiting for the next is a deadlock (e.g. P2P ordering).
Unresponsive ranks are found here too, since they explain hangs (mismatches, which do
too: ``mismatch``); and a hang's end, where its ranks go on (``resumed``).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import replace

from ccld_plugin.diagnose.links import tcp_evidence as chan
from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.diagnose.stalls.mismatch import entered_op, no_majority
from ccld_plugin.diagnose.view import Blocked, JobView, verdict_at
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.codes import OP_NAMES
from ccld_plugin.wire.summary import FLAG_LAST_WORDS, RankSummary

__all__ = ["find_hangs", "find_unresponsive", "resumed", "wait_for_graph"]

# How long a dead rank's verdict waits for its node's leader to read its board (agent
# intervals after its agent's last tick: it may have died just before its next one, and
# the leader reads it at the tick after).
LAST_WORDS_TICKS = 3
ChannelEvidence = Callable[[JobView, GroupInfo, list[int]], chan.Located | None]


def waits_for(
    view: JobView, b: Blocked, blocked: dict[int, Blocked], unknown: AbstractSet[int] = frozenset()
) -> list[int]:
    """The ranks that ``b`` waits for: members that have not arrived at its op, or whose
    arrival is ``unknown`` (their last summary is too old to tell)."""
    if b.p2p:
        peer = b.op.peer
        other = blocked.get(peer)
        if (
            other is not None
            and other.p2p
            and other.op.peer == b.rank
            and other.group.group_id == b.group.group_id
            and other.sends != b.sends
            and other.op.seq == b.op.seq
        ):
            return []  # both ends are in the matching transfer
        return [peer] if peer >= 0 else []
    missing = []
    for m in b.group.ranks:
        if m == b.rank:
            continue
        seq = view.entered_seq(m, b.group.group_id)
        if seq is None or seq < b.op.seq or m in unknown:
            missing.append(m)
    return missing


def wait_for_graph(
    view: JobView, blocked: dict[int, Blocked], unknown: AbstractSet[int] = frozenset()
) -> dict[int, list[int]]:
    return {r: waits_for(view, b, blocked, unknown) for r, b in blocked.items()}


def _walk(graph: dict[int, list[int]], start: int) -> tuple[set[int], list[int] | None]:
    """Roots reachable from ``start`` (ranks that wait for nobody) and a cycle, if any."""
    roots: set[int] = set()
    cycle = None
    path: list[int] = []
    on_path: set[int] = set()
    seen: set[int] = set()

    def visit(r: int) -> None:
        nonlocal cycle
        if r in on_path:
            if cycle is None:
                cycle = path[path.index(r) :]
            return
        if r in seen:
            return
        seen.add(r)
        nexts = graph.get(r)
        if nexts is None:  # not blocked in any op: a root
            roots.add(r)
            return
        path.append(r)
        on_path.add(r)
        for n in nexts:
            visit(n)
        path.pop()
        on_path.discard(r)

    visit(start)
    return roots, cycle


def find_hangs(
    view: JobView,
    threshold_s: Callable[[int], float],
    min_wait_s: float,
    channel_evidence: ChannelEvidence | None = None,
) -> list[Verdict]:
    """Hang verdicts for ops in flight longer than their group's threshold."""
    blocked = {r: b for r, b in view.blocked().items() if b.age_s >= min_wait_s}
    # A rank cut off from the network: its last summary predates the cut and says nothing
    # about what it does now (a stale "waits in recv" would make a false cycle). Left out
    # of the graph, it is a root, reported as a communication hang by _root_hang.
    interval = chan.interval_s(view)
    silent = view.silent(chan.SILENT_INTERVALS * interval)  # chan.is_silent, all at once
    cut_off = [r for r in sorted(silent) if chan.cut_off_rank(view, r, view.summaries) is not None]
    # A rank whose summaries stopped otherwise (frozen, wedged, or late): its last summary
    # may show it in an op it has long left, or outside one it is in. It is a root of
    # unknown state, which find_unresponsive names once its heartbeat is old enough.
    unknown = silent - set(cut_off)
    for r in (*cut_off, *unknown):
        blocked.pop(r, None)
    stuck = [
        b
        for b in blocked.values()
        if b.age_s >= threshold_s(b.group.group_id) and view.idle_s(b.rank) >= min_wait_s
    ]
    if not stuck:
        return []
    graph = wait_for_graph(view, blocked, unknown)
    roots: set[int] = set()
    cycles: list[list[int]] = []
    for b in stuck:
        found, cycle = _walk(graph, b.rank)
        roots |= found
        if cycle and sorted(cycle) not in [sorted(c) for c in cycles]:
            cycles.append(cycle)
    # A root must itself have stopped making progress; one that is merely slow to arrive
    # but still progressing is a straggler, not a hang.
    frozen = roots & unknown
    roots = {
        r
        for r in roots - frozen
        if r in view.summaries and r not in view.gone and view.idle_s(r) >= min_wait_s
    }
    verdicts = [_root_hang(view, r, blocked, graph) for r in sorted(roots)]
    if frozen and not verdicts:
        return []  # the waits end at a rank of unknown state: named unresponsive later
    if not verdicts:
        verdicts += [
            _lone_collective(view, c, blocked) or _deadlock(view, c, blocked) for c in cycles
        ]
    if not verdicts:
        verdicts += _comm_hangs(view, stuck, graph, channel_evidence)
    return verdicts


def _compute_hang(
    view: JobView, root: int, blocked: dict[int, Blocked], graph: dict[int, list[int]]
) -> Verdict:
    waiting = [blocked[r] for r, targets in graph.items() if root in targets]
    by_group: dict[int, list[Blocked]] = {}
    for b in waiting:
        by_group.setdefault(b.group.group_id, []).append(b)
    # The group where the hang shows: most members waiting on the root; collectives before
    # P2P; then the most ranks held up behind its waiters (the root's earlier op in program
    # order holds up those who finish the step after it, e.g. a TP peer stuck mid-step
    # holds its DP peers, while the root's DP peers wait at the step's end and hold up
    # nobody: their wait can start sooner only when their replica ran ahead); then the
    # larger group; then the longer wait.
    held = _held_up(graph, root)
    gid = max(
        by_group,
        key=lambda g: (
            len(by_group[g]),
            not by_group[g][0].p2p,
            len(_held_behind(held, [b.rank for b in by_group[g]])),
            by_group[g][0].group.size,
            max(b.age_s for b in by_group[g]),
        ),
    )
    first = max(by_group[gid], key=lambda b: b.age_s)
    g = first.group
    s = view.summaries[root]
    idle = view.idle_s(root)
    evidence = [
        Evidence.of(
            "not_entered",
            "rank {rank} has not entered {op} seq {seq} on {role}{members}; ranks {waiting} "
            "wait for it ({wait_s:.1f} s)",
            rank=root,
            op=first.op_name,
            seq=first.op.seq,
            role=g.role,
            members=list(g.ranks),
            waiting=sorted(b.rank for b in by_group[gid]),
            wait_s=max(b.age_s for b in by_group[gid]),
        ),
        Evidence.of(
            "in_no_collective",
            "rank {rank} is in no collective; no progress for {idle_s:.1f} s"
            + (" (step {step})" if view.steps_marked else ""),
            rank=root,
            idle_s=idle,
            step=s.step if view.steps_marked else None,
        ),
    ]
    others = sorted(r for r in blocked if r not in {b.rank for b in by_group[gid]})
    if others:
        # One sentence over a list of chains: the template indexes into it.
        chains = [{"rank": r, "waits_for": graph[r], "role": blocked[r].group.role} for r in others]
        links = ", ".join(
            f"{{chains[{i}][rank]}}->{{chains[{i}][waits_for]:join(/)}} ({{chains[{i}][role]}})"
            for i in range(len(chains))
        )
        evidence.append(
            Evidence.of(
                "wait_chain", "blocked elsewhere, traced back to the root: " + links, chains=chains
            )
        )
    return Verdict(
        kind=Kind.HANG,
        cause=Cause.COMPUTE,
        ranks=[root],
        group=g.to_dict(),
        op=first.op_name,
        trace_id=first.trace_id,
        step=s.step,
        onset_s=view.seconds(s.last_progress_ns),
        detected_s=view.seconds(view.now_ns),
        severity=round(idle, 1),
        evidence=evidence,
        stack=s.stack or None,
    )


def resumed(
    view: JobView, hang: Verdict, summaries: list[RankSummary], reported_ns: int
) -> Verdict:
    """The end of ``hang``, reported at ``reported_ns``: every rank it named has made
    progress since (``summaries``, theirs). It lasted from its onset to their progress."""
    back_ns = min(s.last_progress_ns for s in summaries)  # all of them had moved by then
    back_s = view.seconds(back_ns)
    lasted = back_s - (hang.onset_s if hang.onset_s is not None else back_s)
    step = max(s.step for s in summaries)
    return replace(  # the hang's record (its cause, ranks, group, op and onset), ended
        hang,
        kind=Kind.RESUMED,
        ranks=list(hang.ranks),
        step=step,
        detected_s=view.seconds(view.now_ns),
        severity=round(lasted, 1),
        stack=None,
        evidence=[
            Evidence.of(
                "resumed",
                "rank{s} {ranks:join(, )} made progress again by {back_s:.1f} s"
                + (" (step {step})" if view.steps_marked else "")
                + ": the hang reported at {reported_s:.1f} s was a stall of {lasted_s:.1f} s",
                s="s" if len(hang.ranks) > 1 else "",
                ranks=list(hang.ranks),
                back_s=back_s,
                step=step if view.steps_marked else None,
                reported_s=view.seconds(reported_ns),
                lasted_s=lasted,
            )
        ],
    )


def _held_up(graph: dict[int, list[int]], root: int) -> dict[int, list[int]]:
    """Who waits for whom, reversed (rank -> the ranks that wait for it), the root left out."""
    waiters: dict[int, list[int]] = {}
    for r, targets in graph.items():
        for t in targets:
            if r != root:
                waiters.setdefault(t, []).append(r)
    return waiters


def _held_behind(waiters: dict[int, list[int]], start: list[int]) -> set[int]:
    """``start`` and every rank that waits, directly or through others, for one of them."""
    seen = set(start)
    todo = list(start)
    while todo:
        for w in waiters.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _root_hang(
    view: JobView, root: int, blocked: dict[int, Blocked], graph: dict[int, list[int]]
) -> Verdict:
    """A root's hang, with what its peers' connections to it show (channel evidence).

    A root that went silent while its peers' connections to it stall unacknowledged is
    not stuck in compute: its link is cut, and its last summary (which shows it outside
    the op) predates the cut. Otherwise it is a compute-bound hang, and the connections
    show either data it does not read or healthy, idle links.
    """
    v = _compute_hang(view, root, blocked, graph)
    waiters = sorted(r for r, targets in graph.items() if root in targets)
    cut = chan.cut_off_rank(view, root, view.summaries)
    if cut is None:
        v.evidence += chan.toward_evidence(view, root, waiters)
        return v
    stuck = [blocked[r] for r in waiters]
    age = max(b.age_s for b in stuck)
    assert v.group is not None  # _compute_hang always names the root's group
    v.cause, v.ranks, v.link, v.stack = Cause.COMMUNICATION, cut.ranks, cut.link, None
    v.evidence = [
        Evidence.of(
            "waits_for_silent",
            "ranks {waiting} wait for rank {rank} in {op} on {role}{members} ({wait_s:.1f} s); "
            "its last summary predates the stall",
            waiting=waiters,
            rank=root,
            op=v.op,
            role=v.group["role"],
            members=v.group["ranks"],
            wait_s=age,
        ),
        *cut.evidence,
    ]
    v.onset_s = view.seconds(min(b.op.enter_ns for b in stuck))
    v.step = max(view.summaries[r].step for r in waiters)  # the root's own is stale
    v.severity = round(age, 1)
    return v


def _lone_collective(
    view: JobView, cycle: list[int], blocked: dict[int, Blocked]
) -> Verdict | None:
    """A cycle that is one group's members disagreeing on their next op: one member in a
    collective that none of the others entered, each of them in a point-to-point transfer
    of the same group (a pipeline's stages sending activations while one of them, alone,
    began a collective over the pipeline). A mismatch, as find_mismatches' of two ops in
    one seq, named by majority: the member in the collective; both with two members."""
    collectives = [blocked[r] for r in cycle if not blocked[r].p2p]
    if len(collectives) != 1:
        return None
    b = collectives[0]
    gid = b.group.group_id
    others = [m for m in b.group.ranks if m != b.rank]
    transfers = [blocked[m] for m in others if m in blocked]
    if len(transfers) < len(others) or not all(
        t.p2p and t.group.group_id == gid for t in transfers
    ):
        return None
    if any((view.entered_seq(m, gid) or -1) >= b.op.seq for m in others):
        return None
    tie = len(others) < 2
    evidence = [
        entered_op(b.rank, b.op_name, b.op.bytes, b.op.seq, b.group),
        Evidence.of(
            "in_transfers",
            "ranks {ranks} have not entered it: each is in a point-to-point transfer of "
            "{role}{members} ({ops:join(; )}) for {wait_s:.1f} s",
            ranks=others,
            role=b.group.role,
            members=list(b.group.ranks),
            ops=[
                f"rank {t.rank} {t.op_name} {'to' if t.sends else 'from'} {t.op.peer}"
                for t in transfers
            ],
            wait_s=max(t.age_s for t in transfers),
        ),
    ]
    if tie:
        evidence.append(no_majority())
    ranks = sorted(b.group.ranks) if tie else [b.rank]
    return verdict_at(view, b, Kind.MISMATCH, Cause.SOFTWARE, ranks, evidence, round(b.age_s, 1))


def _deadlock(view: JobView, cycle: list[int], blocked: dict[int, Blocked]) -> Verdict:
    """The cycle told from its oldest wait: whichever member a round's walk started from,
    the verdict is at the same op (one finding, reported once)."""
    at = min(range(len(cycle)), key=lambda i: (blocked[cycle[i]].op.enter_ns, cycle[i]))
    cycle = cycle[at:] + cycle[:at]
    ops = [blocked[r] for r in cycle]
    first = ops[0]
    evidence = [b.waits_in() for b in ops]
    evidence.append(
        Evidence.of(
            "cycle", "the waits form a cycle: {cycle:join( -> )} -> {cycle[0]}", cycle=cycle
        )
    )
    severity = round(max(b.age_s for b in ops), 1)
    return verdict_at(view, first, Kind.DEADLOCK, Cause.SOFTWARE, sorted(cycle), evidence, severity)


def _comm_hangs(
    view: JobView,
    stuck: list[Blocked],
    graph: dict[int, list[int]],
    channel_evidence: ChannelEvidence | None,
) -> list[Verdict]:
    """Everyone arrived, yet the op does not finish: data does not flow. An op that waits
    for a member stuck in such an op (a stage's recv from a rank held in its group's
    collective) is its effect, not a hang of its own."""
    verdicts, seen, located = [], set(), []
    arrived = [b for b in stuck if not graph[b.rank]]
    for b in sorted(arrived, key=lambda b: -b.age_s):
        if b.group.group_id in seen:
            continue
        seen.add(b.group.group_id)
        members = [b.op.peer, b.rank] if b.p2p else list(b.group.ranks)
        ranks, link, cause = sorted(members), None, Cause.COMMUNICATION
        evidence = [
            Evidence.of(
                "all_entered",
                "all of {role}{members} entered {op} seq {seq}; it has not completed for "
                "{wait_s:.1f} s",
                role=b.group.role,
                members=list(b.group.ranks),
                op=b.op_name,
                seq=b.op.seq,
                wait_s=b.age_s,
            )
        ]
        found = channel_evidence(view, b.group, members) if channel_evidence else None
        if found is not None:
            ranks, link, cause = found.ranks, found.link, found.cause
            evidence += found.evidence
        else:
            evidence.append(
                Evidence.of(
                    "no_channel_data",
                    "no channel data to name the link: every member is a suspect",
                    suspects=ranks,
                )
            )
        culprit = view.summaries.get(ranks[0]) if len(ranks) == 1 else None
        v = verdict_at(view, b, Kind.HANG, cause, ranks, evidence, round(b.age_s, 1))
        v.link = link
        # where a compute-bound culprit's host thread is (e.g. what it launched last)
        v.stack = (culprit.stack or None) if culprit and cause == Cause.COMPUTE else None
        verdicts.append(v)
        if found is not None:
            located.append(v)
    return _fold(located) if located else verdicts


def _fold(verdicts: list[Verdict]) -> list[Verdict]:
    """One verdict per culprit the channel evidence named: the other groups stuck on the
    same culprit (and those without channel evidence, stuck downstream) are its effects."""
    out: dict[tuple[int, ...], Verdict] = {}
    for v in verdicts:
        first = out.setdefault(tuple(v.ranks), v)
        if first is not v:
            # The other group's hang is folded in whole: its first item (all_entered) is
            # nested under "item" as its record, so readers need not parse the sentence.
            first.evidence.append(
                Evidence.of(
                    "also_stuck", "also stuck on it: {item[text]}", item=v.evidence[0].to_dict()
                )
            )
    return list(out.values())


def _last_words_due(view: JobView, s: RankSummary, shared_hosts: AbstractSet[str]) -> bool:
    """Whether the node of a rank seen dead may still bring the state its board kept when
    it died (its leader reads a dead node-mate's board at its next tick, or on its own
    way out: the rank's last summary can be an interval older than its death, a step or
    more behind): until that summary comes, for at most LAST_WORDS_TICKS intervals. (A
    live node-mate's report from a later tick says nothing: it may predate the death; an
    8-rank job's rank killed at step 7 was named at step 2 on that rule.) A rank alone on
    its host has nobody to bring it: no wait."""
    if s.flags & FLAG_LAST_WORDS or s.host not in shared_hosts:
        return False
    waited_s = (view.now_ns - s.heartbeat_ns) / 1e9
    return waited_s < LAST_WORDS_TICKS * chan.interval_s(view)


def _shared_hosts(view: JobView) -> set[str]:
    """The hosts of two or more ranks (exited ones count: a leader on its way out
    publishes its node's last words)."""
    seen: set[str] = set()
    shared: set[str] = set()
    for s in view.summaries.values():
        (shared if s.host in seen else seen).add(s.host)
    return shared


def find_unresponsive(view: JobView, unresponsive_s: float) -> list[Verdict]:
    """Ranks whose process is gone without leaving through our exit path, or whose agent
    heartbeat stopped (process wedged, e.g. holding the GIL)."""
    verdicts = []
    t = view.columns
    # the ranks that may be unresponsive, from the columns: not exited, and gone or with
    # an old heartbeat
    old = (view.now_ns - t.heads["heartbeat_ns"]) / 1e9 >= unresponsive_s
    maybe = t.ranks[~t.exited & old].tolist()
    shared_hosts = _shared_hosts(view) if view.gone else set()
    for rank in sorted({*maybe, *(r for r in view.gone if r in view.summaries)}):
        s = view.summaries[rank]
        if s.exited:
            continue
        age = (view.now_ns - s.heartbeat_ns) / 1e9
        gone = rank in view.gone
        if not gone and age < unresponsive_s:
            continue
        if gone and not view.final and _last_words_due(view, s, shared_hosts):
            continue
        if not gone and (
            not chan.peers_reported_since(view, rank, max(s.time_ns, s.heartbeat_ns))
            or chan.cut_off_rank(view, rank, view.summaries) is not None
        ):
            # alive but cut off (a communication hang: find_hangs'), or too soon to tell
            continue
        ops = view.ops_of(rank)
        evidence = [
            Evidence.of(
                "process_gone",
                "process {pid} on {host} no longer exists",
                pid=s.pid,
                host=s.host,
            )
            if gone
            else Evidence.of(
                "heartbeat_stopped",
                "agent heartbeat stopped {age_s:.1f} s ago (process wedged?)",
                age_s=age,
            )
        ]
        last: dict[str, object] = {
            "op": None,
            "seq": None,
            "role": None,
            "members": None,
        }  # none entered
        if ops:
            op, g = ops[0]
            last = {
                "op": OP_NAMES.get(op.op, "?"),
                "seq": op.seq,
                "role": g.role,
                "members": list(g.ranks),
            }
        evidence.append(
            Evidence.of(
                "last_op",
                ("last step {step}; " if view.steps_marked else "")
                + ("in {op} seq {seq} on {role}{members}" if ops else "in no collective"),
                step=s.step if view.steps_marked else None,
                **last,
            )
        )
        if not gone and view.reach.get(rank):
            evidence.append(
                Evidence.of(
                    "host_answers",
                    "its host {host} answers a TCP handshake from the diagnoser: the link is up, "
                    "the fault is in the process",
                    host=s.host,
                )
            )
        group = ops[0][1].to_dict() if ops else None
        verdicts.append(
            Verdict(
                kind=Kind.UNRESPONSIVE,
                cause=Cause.UNKNOWN,
                ranks=[rank],
                group=group,
                step=s.step,
                onset_s=view.seconds(s.heartbeat_ns),
                detected_s=view.seconds(view.now_ns),
                severity=round(age, 1),
                evidence=evidence,
            )
        )
    return verdicts
