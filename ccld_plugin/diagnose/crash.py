"""Crashes: ranks that left on an uncaught exception of their own (an out-of-memory error,
a bug in the training code), said with the exception and where it was raised. A rank whose
exception came out of one of its ops (gloo raises when a peer's connection closes) left on
someone else's failure: it is not named. Ranks that crashed with the same exception are
one finding."""

from __future__ import annotations

from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.wire.codes import OP_NAMES

__all__ = ["find_crashes"]

SHOWN_RANKS = 8  # ranks given their own evidence line in one verdict


def find_crashes(view: JobView) -> list[Verdict]:
    """One verdict per exception that ranks left on (the first of them in time first)."""
    t = view.columns
    crashed = t.ranks[t.crashed].tolist()
    by_exception: dict[str, list[int]] = {}
    for r in sorted(crashed, key=lambda r: (view.summaries[r].time_ns, r)):
        stack = view.summaries[r].stack
        by_exception.setdefault(stack[-1] if stack else "", []).append(r)
    verdicts = []
    for exception, ranks in by_exception.items():
        first = view.summaries[ranks[0]]
        where = first.stack[-2] if len(first.stack) > 1 else None
        evidence = [
            Evidence.of(
                "exception",
                "left on an uncaught {exception}" + (", raised at {where}" if where else ""),
                exception=exception or "exception (not recorded)",
                where=where,
            )
        ]
        for r in ranks[:SHOWN_RANKS]:
            s = view.summaries[r]
            op = next(iter(view.ops_of(r)), None)
            evidence.append(
                Evidence.of(
                    "crashed_at",
                    "rank {rank} left at step {step}, {seconds:.1f} s into the job"
                    + (", in {op} on {role}{members}" if op else ""),
                    rank=r,
                    step=s.step,
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
        verdicts.append(
            Verdict(
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
        )
    return verdicts
