"""Mismatches: members of a group that issued different collectives. Either two members
entered the same trace id (group, seq) with different ops or sizes, or a member left the
job (a clean exit) short of a collective its peers wait in: it issued fewer collectives on
the group (its loop ended early, or it skipped one) and will never enter it. A mismatch
explains the hangs it causes (see analyzer). A transfer waited in whose peer left the same
way is one too: one end posted a send or receive that the other never will."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping

import numpy as np

from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.diagnose.view import Blocked, JobView, verdict_at
from ccld_plugin.topology import GroupInfo, trace_id
from ccld_plugin.wire.codes import FLAG_P2P, OP_NAMES

__all__ = ["entered_op", "find_left_early", "find_mismatches", "no_majority"]

# Ops whose sizes may legitimately differ across members (uneven splits, root-only lists).
_SIZE_MAY_DIFFER = {
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "all_gather",
    "reduce_scatter",
    "coalesced",
    "barrier",
    "monitored_barrier",
}


def find_mismatches(
    view: JobView,
    settle_s: Callable[[int], float],
    history: Callable[[int], Mapping[int, int]] | None = None,
) -> list[Verdict]:
    """Members that entered the same trace id with different ops (or sizes). A tie waits
    for the members not seen in the seq: until each has reported since and stood still
    for ``settle_s(group_id)`` (the group's hang threshold), its op may still come.
    ``history(group_id)``: the sizes of the group's recent collectives (seq -> bytes),
    which break a tie that the sibling groups do not."""
    seen: dict[tuple[int, int], dict[int, tuple[str, int, int]]] = {}
    groups: dict[int, GroupInfo] = {}
    in_ops = view.in_ops()
    for rank in [r for r in view.summaries if r in in_ops] if in_ops else []:
        for op, g in view.ops_of(rank):
            if op.flags & FLAG_P2P:
                continue
            seen.setdefault((g.group_id, op.seq), {})[rank] = (
                OP_NAMES.get(op.op, "?"),
                op.bytes,
                op.enter_ns,
            )
            groups[g.group_id] = g
    verdicts = []
    # per (role, seq): the (op, bytes) sibling groups ran; built at the first tie
    unanimous: dict[tuple[str, int], Counter[tuple[str, int]]] | None = None
    for (gid, seq), entries in seen.items():
        if len(entries) < 2:
            continue
        names = {name for name, _, _ in entries.values()}
        sizes_matter = not (names & _SIZE_MAY_DIFFER)
        sig = {r: (n, b if sizes_matter else 0) for r, (n, b, _) in entries.items()}
        counts = Counter(sig.values())
        if len(counts) < 2:
            continue
        g = groups[gid]
        top, top_n = counts.most_common(1)[0]
        if not _settled(view, g, seq, entries, top_n, settle_s(gid)):
            continue
        tie = list(counts.values()).count(top_n) > 1
        evidence = [entered_op(r, n, b, seq, g) for r, (n, b, _) in sorted(entries.items())]
        if tie:
            # No majority inside the group (two members): what the sibling groups of the
            # same role ran as this seq decides, when they agree on one of the members' ops.
            if unanimous is None:
                unanimous = _unanimous_ops(seen, groups)
            # (sizes compared where they must match: the same op with half the bytes, a
            # live gloo job's, is the dissent)
            sibling: Counter[tuple[str, int]] = Counter()
            for (n, b), count in unanimous.get((g.role, seq), Counter()).items():
                sibling[(n, b if sizes_matter else 0)] += count
            agreed = [x for x in sibling.most_common(1) if x[0] in sig.values()]
            if agreed:
                (top, count), tie = agreed[0], False
                evidence.append(
                    Evidence.of(
                        "sibling_majority",
                        "{count} sibling {role} groups ran {op}"
                        + (" ({bytes} B)" if sizes_matter else "")
                        + " as seq {seq}",
                        count=count,
                        role=g.role,
                        op=top[0],
                        bytes=top[1] if sizes_matter else None,
                        seq=seq,
                    )
                )
        if tie and history is not None:
            usual = _usual_op(entries, history(gid), g, seq)
            if usual is not None:
                top, tie = sig[usual[0]], False
                evidence.append(usual[1])
        culprits = sorted(r for r, v in sig.items() if tie or v != top)
        if tie:
            evidence.append(no_majority())
        verdicts.append(
            Verdict(
                kind=Kind.MISMATCH,
                cause=Cause.SOFTWARE,
                ranks=culprits,
                group=g.to_dict(),
                op=entries[culprits[0]][0],
                trace_id=trace_id(gid, seq),
                step=view.summaries[culprits[0]].step,
                onset_s=view.seconds(min(e for _, _, e in entries.values())),
                detected_s=view.seconds(view.now_ns),
                evidence=evidence,
            )
        )
    return verdicts


def entered_op(rank: int, op: str, size: int, seq: int, g: GroupInfo) -> Evidence:
    return Evidence.of(
        "entered_op",
        "rank {rank} entered {op} ({bytes} B) as seq {seq} of {role}{members}",
        rank=rank,
        op=op,
        bytes=size,
        seq=seq,
        role=g.role,
        members=list(g.ranks),
    )


def _settled(
    view: JobView,
    g: GroupInfo,
    seq: int,
    entries: dict[int, tuple[str, int, int]],
    top_n: int,
    settle_s: float,
) -> bool:
    """Whether the members seen in ``seq`` of ``g`` are enough to judge it. A member not
    seen in it may not have reported since (its summary predates the dissent) or may still
    be on its way (short of the seq, in the compute before it), and its op can still turn
    a tie into a majority: judge once the ops seen hold a majority of the whole group, or
    every member not seen in it has reported since and made no progress for ``settle_s``
    since the last of them entered. Progress alone cannot tell: a rank computing between
    two collectives makes none, and a live 4-rank job was judged [0, 3] before ranks 1
    and 2 came out of their backward pass and made rank 3 the minority."""
    if 2 * top_n > len(g.ranks):
        return True
    latest = max(e for _, _, e in entries.values())
    for r in g.ranks:
        s = view.summaries.get(r)
        if r in entries or s is None or r in view.gone:
            continue
        if s.time_ns < latest:
            return False
        entered = view.entered_seq(r, g.group_id)
        still_ns = view.now_ns - max(latest, s.last_progress_ns)
        if entered is not None and entered < seq and still_ns < settle_s * 1e9:
            return False
    return True


def _usual_op(
    entries: dict[int, tuple[str, int, int]], sizes: Mapping[int, int], g: GroupInfo, seq: int
) -> tuple[int, Evidence] | None:
    """Where the members split evenly: the member to go by, with the evidence, from the
    group's recent collectives (``sizes``: seq -> bytes). First what the group ran after
    a collective of the size of its last one (seq - 1): a member that skipped one enters
    a size the group ran too, but not there; else which sizes it ran at all (a stray op of
    a size never run there). None where that splits no member from the others, or the
    members it singles out entered different ops."""
    before = sizes.get(seq - 1)
    after = Counter(
        b for s, b in sizes.items() if s < seq and s - 1 in sizes and sizes[s - 1] == before
    )
    ran = Counter(v for s, v in sizes.items() if s < seq)
    rules = (
        (after, "followed a collective of {after} B with one of {bytes} B {count} times", before),
        (ran, "ran {count} collectives of {bytes} B", None),
    )
    for counts, what, follows in rules:
        usual = sorted(r for r, (_, b, _) in entries.items() if counts.get(b))
        if usual and len(usual) < len(entries) and len({entries[r][:2] for r in usual}) == 1:
            op, size, _ = entries[usual[0]]
            return usual[0], Evidence.of(
                "group_history",
                "{role}{members} " + what + " before ({op} as seq {seq}: ranks {usual}); "
                "none of the size the others entered",
                role=g.role,
                members=list(g.ranks),
                after=follows,
                count=counts[size],
                bytes=size,
                op=op,
                seq=seq,
                usual=usual,
            )
    return None


def _unanimous_ops(
    seen: dict[tuple[int, int], dict[int, tuple[str, int, int]]], groups: dict[int, GroupInfo]
) -> dict[tuple[str, int], Counter[tuple[str, int]]]:
    """Per (role, seq): how many groups of that role ran each (op, bytes) as that seq,
    counting the groups whose members all ran the same one."""
    out: dict[tuple[str, int], Counter[tuple[str, int]]] = defaultdict(Counter)
    for (gid, seq), entries in seen.items():
        ops = {(n, b) for n, b, _ in entries.values()}
        if len(ops) == 1:
            out[(groups[gid].role, seq)][ops.pop()] += 1
    return out


def find_left_early(view: JobView, min_wait_s: float) -> list[Verdict]:
    """Collectives that members have waited in for ``min_wait_s`` (any time, in a
    post-mortem) while another member left the job through its exit path, with no op of
    its raising, without entering them. Named: the side short of the group's majority
    (those who left; where most left, those who issued one more); in a tie, see
    ``_tie_broken``. Members still on their way decide a tie first."""
    t = view.columns
    # (one whose op raised left on that failure, as the peers of a dead rank do)
    exited = set(t.ranks[t.left_cleanly].tolist()) - view.gone
    if not exited:
        return []
    waits: dict[tuple[int, int], list[Blocked]] = defaultdict(list)
    verdicts = []
    for b in view.blocked().values():
        if view.summaries[b.rank].exited or not (view.final or b.age_s >= min_wait_s):
            continue
        if not b.p2p:
            waits[(b.group.group_id, b.op.seq)].append(b)
        elif (
            b.op.peer in exited
            and view.summaries[b.rank].time_ns > view.summaries[b.op.peer].time_ns
        ):
            # (as the rank stood after its peer left: a summary from before it may show
            # the wait its peer's last send ended; a diagnoser's last round on its way
            # out, final too, reads such summaries)
            verdicts.append(_transfer_left_early(view, b))
    for (gid, seq), waiting in waits.items():
        g = waiting[0].group
        entered = {m: view.entered_seq(m, gid) or 0 for m in g.ranks}
        left = [m for m in g.ranks if m in exited and entered[m] < seq]
        if not left:
            continue
        issued = [m for m in g.ranks if entered[m] >= seq]
        evidence = [_left(m, entered[m], seq, g) for m in left]
        evidence += [b.waits_in() for b in sorted(waiting, key=lambda b: b.rank)]
        if 2 * len(issued) > g.size:
            named = left
        elif 2 * len(left) > g.size:
            named = issued
        elif len(left) + len(issued) < g.size:
            continue  # a member on its way decides
        else:
            named, why = _tie_broken(view, g, seq, left, issued)
            evidence.append(why)
        b = min(waiting, key=lambda b: b.op.enter_ns)
        verdicts.append(
            Verdict(
                kind=Kind.MISMATCH,
                cause=Cause.SOFTWARE,
                ranks=sorted(named),
                group=g.to_dict(),
                op=b.op_name,
                trace_id=b.trace_id,
                step=view.summaries[min(named)].step,
                onset_s=view.seconds(b.op.enter_ns),
                detected_s=view.seconds(view.now_ns),
                evidence=evidence,
            )
        )
    return _one_per_finding(verdicts)


def _one_per_finding(verdicts: list[Verdict]) -> list[Verdict]:
    """The verdicts that name the same ranks as one: a rank that left early leaves its
    peers waiting in each of its groups and transfers. Told at the oldest wait, with the
    others' evidence of who left and who waits."""
    by_ranks: dict[tuple[int, ...], list[Verdict]] = defaultdict(list)
    for v in verdicts:
        by_ranks[tuple(v.ranks)].append(v)
    out = []
    for same in by_ranks.values():
        same.sort(key=lambda v: v.onset_s if v.onset_s is not None else 0.0)
        first = same[0]
        for v in same[1:]:
            first.evidence += [e for e in v.evidence if e.fact in ("left_early", "waits_in")]
        out.append(first)
    return out


def _tie_broken(
    view: JobView, g: GroupInfo, seq: int, left: list[int], issued: list[int]
) -> tuple[list[int], Evidence]:
    """A tie between members that left short of ``seq`` and members that entered it. As
    the sibling groups (same role and size, with collectives of their own) ran: through
    ``seq`` (those who left are short) or not as far (those in it issued one more). Where
    they do not tell, as the job's other ranks went on: still running (those who left
    ended early) or all gone the same way (those in it issued one more)."""
    reached = ended = 0
    for s in view.topology.siblings(g.role):
        if s.group_id == g.group_id or s.size != g.size:
            continue
        counts = [view.entered_seq(m, s.group_id) or 0 for m in s.ranks]
        if min(counts) >= seq:
            reached += 1
        elif 0 < max(counts) < seq and all(
            m in view.summaries and view.summaries[m].exited for m in s.ranks
        ):
            ended += 1
    if reached != ended:
        return (left if reached > ended else issued), Evidence.of(
            "sibling_counts",
            "{reached} sibling {role} groups reached seq {seq}, {ended} ended before it",
            reached=reached,
            ended=ended,
            role=g.role,
            seq=seq,
        )
    return _as_the_job_went_on(view, g.ranks, left, issued)


def _as_the_job_went_on(
    view: JobView, members: tuple[int, ...], left: list[int], issued: list[int]
) -> tuple[list[int], Evidence]:
    """A tie broken by the job's other ranks: still running (those who left ended early)
    or all gone the same way (those who issued one more). Else every member is named."""
    t = view.columns
    others = ~np.isin(t.ranks, list(members))
    running = int((others & ~t.exited & ~np.isin(t.ranks, list(view.gone))).sum())
    if others.any() and (running > 0) != bool(t.left_cleanly[others].all()):
        return (left if running else issued), Evidence.of(
            "job_went_on",
            "{running} of the job's {others} other ranks still ran",
            running=running,
            others=int(others.sum()),
        )
    return [*left, *issued], no_majority()


def _transfer_left_early(view: JobView, b: Blocked) -> Verdict:
    """``b`` waits in a transfer whose peer left through its exit path: the peer will not
    post its side. Which end is wrong (one too few, or one too many) a pair does not say:
    the job's other ranks decide as for a collective's tie."""
    peer = b.op.peer
    named, why = _as_the_job_went_on(view, (b.rank, peer), [peer], [b.rank])
    evidence = [
        Evidence.of(
            "left_early",
            "rank {rank} left the job (a clean exit) without posting its side of rank "
            "{waiting}'s {op} (transfer {seq} between them)",
            rank=peer,
            waiting=b.rank,
            op=b.op_name,
            seq=b.op.seq,
        ),
        b.waits_in(),
        why,
    ]
    return verdict_at(view, b, Kind.MISMATCH, Cause.SOFTWARE, sorted(named), evidence)


def no_majority() -> Evidence:
    """A tie with nothing to break it: every member is named."""
    return Evidence.of("no_majority", "no majority among the members: all are named")


def _left(rank: int, entered: int, seq: int, g: GroupInfo) -> Evidence:
    return Evidence.of(
        "left_early",
        "rank {rank} left the job (a clean exit) after {entered} collectives on "
        "{role}{members}: it will not enter seq {seq}",
        rank=rank,
        entered=entered,
        role=g.role,
        members=list(g.ranks),
        seq=seq,
    )
