"""Crashes: ranks that left on an uncaught exception of their own (an out-of-memory error,
a bug in the training code, a collective called with bad arguments), said with the
exception and where it was raised. A rank whose exception came out of one of its ops
because a peer failed (gloo raises when a peer's connection closes, NCCL when a peer's
process exits, both when a wait times out) left on someone else's failure: it is not
named. Ranks that crashed with the same exception are one finding."""

from __future__ import annotations

from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.wire.codes import OP_NAMES

__all__ = ["find_crashes", "peer_failure"]

SHOWN_RANKS = 8  # ranks given their own evidence line in one verdict
# What an op raises with when the failure is a peer's or the network's, not the caller's
# (gloo, NCCL, the store), lower case: a connection that broke, a peer's process that
# ended, a wait that timed out, a peer's message that disagreed with ours.
PEER_FAILURES = (
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "remote process exited",
    "network error",
    "remote error",
    "aborted",
    "preamble",
)
# Frames of installed packages (torch, its helpers) and of the plugin are where a raise
# surfaces, not where the training code went wrong: "raised at" names the innermost frame
# outside them.
LIBRARY_DIRS = ("/site-packages/", "/dist-packages/", "/ccld_plugin/")


def peer_failure(exception: str) -> bool:
    """Whether an exception line (as a crash record's last entry) says that a peer or the
    network failed the op."""
    text = exception.lower()
    return any(marker in text for marker in PEER_FAILURES)


def find_crashes(view: JobView, settle_s: float) -> list[Verdict]:
    """One verdict per exception that ranks left on (the first of them in time first);
    or, where every crash came out of an op, the first rank's if its op raised on an error
    of its own before anything else failed (see _first_op_failure)."""
    t = view.columns
    crashed = t.ranks[t.crashed].tolist()
    by_exception: dict[str, list[int]] = {}
    for r in sorted(crashed, key=lambda r: (view.summaries[r].time_ns, r)):
        stack = view.summaries[r].stack
        by_exception.setdefault(stack[-1] if stack else "", []).append(r)
    verdicts = [_crash(view, exception, ranks) for exception, ranks in by_exception.items()]
    if not verdicts:
        first = _first_op_failure(view, settle_s)
        if first is not None:
            verdicts.append(_crash(view, view.summaries[first].stack[-1], [first]))
    return verdicts


def _first_op_failure(view: JobView, settle_s: float) -> int | None:
    """The rank that left first on an exception out of an op of its own, where that
    exception is not a peer's failure (a collective called with bad arguments raises on
    its caller alone; its peers' ops raise after, when its connections close) and no rank
    was seen gone (killed) before it."""
    t = view.columns
    left = t.ranks[t.errored_crashes].tolist()
    if not left:
        return None
    first = min(left, key=lambda r: (view.summaries[r].time_ns, r))
    s = view.summaries[first]
    if not s.stack or peer_failure(s.stack[-1]):
        return None
    settle_ns = settle_s * 1e9
    if any(
        view.summaries[r].heartbeat_ns < s.time_ns - settle_ns
        for r in view.gone
        if r in view.summaries
    ):
        return None
    return first


def _crash(view: JobView, exception: str, ranks: list[int]) -> Verdict:
    first = view.summaries[ranks[0]]
    where = _raised_at(first.stack)
    evidence = [
        Evidence.of(
            "exception",
            "left on an uncaught {exception}" + (", raised at {where}" if where else ""),
            exception=exception or "exception (not recorded)",
            where=where,
        )
    ]
    marked = view.steps_marked
    for r in ranks[:SHOWN_RANKS]:
        s = view.summaries[r]
        op = next(iter(view.ops_of(r)), None)
        evidence.append(
            Evidence.of(
                "crashed_at",
                "rank {rank} left"
                + (" at step {step}" if marked else "")
                + ", {seconds:.1f} s into the job"
                + (", in {op} on {role}{members}" if op else ""),
                rank=r,
                step=s.step if marked else None,
                seconds=view.seconds(s.time_ns),
                op=OP_NAMES.get(op[0].op, "?") if op else None,
                role=op[1].role if op else None,
                members=list(op[1].ranks) if op else None,
            )
        )
    if len(ranks) > SHOWN_RANKS:
        evidence.append(
            Evidence.of(
                "more_crashed", "... and {count} more ranks", count=len(ranks) - SHOWN_RANKS
            )
        )
    return Verdict(
        kind=Kind.CRASH,
        cause=Cause.SOFTWARE,
        ranks=sorted(ranks),
        group=None,
        step=first.step,
        onset_s=view.seconds(first.time_ns),
        detected_s=view.seconds(view.now_ns),
        evidence=evidence,
        stack=list(first.stack) or None,
    )


def _raised_at(stack: list[str]) -> str | None:
    """The innermost frame of the training code (outside installed packages and the
    plugin), else the innermost frame, of a crash record (frames, then the exception)."""
    frames = stack[:-1]
    for frame in reversed(frames):
        if not any(d in frame for d in LIBRARY_DIRS):
            return frame
    return frames[-1] if frames else None
