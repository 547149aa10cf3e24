"""``ccld trace``: a job's boards as a timeline in the Trace Event format (the JSON that
Perfetto and chrome://tracing open).

One process per rank, one thread (track) per group of it, and a "steps" track; each op a
complete ("X") slice named by op, role and trace id; flow arrows ("s"/"t"/"f") join the
slices of one collective (one trace id) across ranks, and a send to its receive; verdicts
are instant ("i") events on the culprit's track. Times are microseconds since the job's
start on the diagnoser's clock, the timebase of the verdicts.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ccld_plugin.postmortem.boards import JobBoards, RankBoard
from ccld_plugin.postmortem.outputs import replace_file
from ccld_plugin.topology import trace_id
from ccld_plugin.wire.codes import FLAG_P2P, FLAG_SEND, OP_NAMES, STATE_IN_FLIGHT, STATE_NAMES

__all__ = ["STEPS_TID", "trace_events", "write_trace"]

STEPS_TID = 0  # a rank's group tracks are tid slot + 1


@dataclass(frozen=True)
class _Slice:
    pid: int
    tid: int
    ts: float
    flow_key: tuple


def _us(ns: int, start_ns: int) -> float:
    return round((ns - start_ns) / 1e3, 3)


def trace_events(boards: JobBoards, verdicts: Iterable[dict] = ()) -> list[dict[str, Any]]:
    start = min(b.diag(b.snap.header.start_mono_ns) for b in boards.ranks.values())
    events: list[dict[str, Any]] = []
    slices: list[_Slice] = []
    for rank, b in sorted(boards.ranks.items()):
        events += _tracks(rank, b)
        events += _steps(rank, b, start)
        ev, sl = _ops(rank, b, start)
        events += ev
        slices += sl
    events += _flows(slices)
    events += _verdicts(boards, verdicts)
    return events


def _tracks(rank: int, b: RankBoard) -> list[dict[str, Any]]:
    h = b.snap.header
    out = [
        _meta("process_name", rank, 0, f"rank {rank} (pid {h.pid} on {h.host})"),
        _meta("process_sort_index", rank, 0, rank, key="sort_index"),
        _meta("thread_name", rank, STEPS_TID, "steps"),
    ]
    for slot, g in enumerate(b.groups):
        out.append(_meta("thread_name", rank, slot + 1, f"{g.role}{list(g.ranks)}"))
        out.append(_meta("thread_sort_index", rank, slot + 1, slot + 1, key="sort_index"))
    return out


def _meta(name: str, pid: int, tid: int, value: object, key: str = "name") -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {key: value}}


def _steps(rank: int, b: RankBoard, start: int) -> list[dict[str, Any]]:
    """A slice per step, from its first collective's start to the next step's (the board
    keeps the step of each op, not the step boundaries; the current step starts where the
    rank marked it, also before its first op: a rank hung in compute)."""
    ops, h = b.snap.ops, b.snap.header
    if not len(ops):
        return []
    firsts = {int(s): int(ops["enter_ns"][ops["step"] == s].min()) for s in np.unique(ops["step"])}
    if h.step_start_ns and (h.step in firsts or h.step > max(firsts)):
        firsts[h.step] = min(firsts.get(h.step, h.step_start_ns), h.step_start_ns)
    end = b.last_seen_ns()
    steps = sorted(firsts.items())
    out = []
    for (step, t0), nxt in zip(steps, [*steps[1:], (None, end)], strict=True):
        out.append(
            {
                "ph": "X",
                "name": f"step {step}",
                "cat": "step",
                "pid": rank,
                "tid": STEPS_TID,
                "ts": _us(b.diag(t0), start),
                "dur": _us(nxt[1], t0),
                "args": {"step": step},
            }
        )
    return out


def _ops(rank: int, b: RankBoard, start: int) -> tuple[list[dict[str, Any]], list[_Slice]]:
    end = b.last_seen_ns()
    events, slices = [], []
    for r in b.snap.ops:
        slot, seq, flags = int(r["group_slot"]), int(r["seq"]), int(r["flags"])
        if slot >= len(b.groups):
            continue
        g = b.groups[slot]
        op = OP_NAMES.get(int(r["op"]), "unknown")
        trace = trace_id(g.group_id, seq)
        state = int(r["state"])
        t0 = int(r["enter_ns"])
        t1 = end if state == STATE_IN_FLIGHT else max(t0, int(r["exit_ns"]))
        args: dict[str, Any] = {
            "trace_id": trace,
            "group": list(g.ranks),
            "bytes": int(r["bytes"]),
            "step": int(r["step"]),
            "state": STATE_NAMES.get(state, str(state)),
        }
        key: tuple = (g.group_id, seq)
        if flags & FLAG_P2P:
            peer = int(r["peer"])
            args["peer"] = peer
            sender, receiver = (rank, peer) if flags & FLAG_SEND else (peer, rank)
            key = (g.group_id, seq, sender, receiver)
        ts = _us(b.diag(t0), start)
        events.append(
            {
                "ph": "X",
                "name": f"{op} {g.role} {trace}",
                "cat": "p2p" if flags & FLAG_P2P else "collective",
                "pid": rank,
                "tid": slot + 1,
                "ts": ts,
                "dur": _us(t1, t0),
                "args": args,
            }
        )
        slices.append(_Slice(rank, slot + 1, ts, key))
    return events, slices


def _flows(slices: list[_Slice]) -> list[dict[str, Any]]:
    """Arrows through the slices of each collective (or send and receive), in the order the
    ranks entered it; each flow point binds to the slice it starts in ("bp": "e")."""
    by_key: dict[tuple, list[_Slice]] = defaultdict(list)
    for s in slices:
        by_key[s.flow_key].append(s)
    out = []
    for flow_id, members in enumerate(m for m in by_key.values() if len(m) > 1):
        members.sort(key=lambda s: s.ts)
        for i, s in enumerate(members):
            ph = "s" if i == 0 else "f" if i == len(members) - 1 else "t"
            out.append(
                {
                    "ph": ph,
                    "id": flow_id + 1,
                    "name": "collective",
                    "cat": "flow",
                    "pid": s.pid,
                    "tid": s.tid,
                    "ts": s.ts,
                    "bp": "e",
                }
            )
    return out


def _verdicts(boards: JobBoards, verdicts: Iterable[dict]) -> list[dict[str, Any]]:
    """Each verdict at its onset (else when it was detected) on each culprit's track of the
    verdict's group (else its steps track)."""
    out = []
    for v in verdicts:
        onset = v.get("onset_s")
        at = float(onset if onset is not None else v.get("detected_s") or 0.0)
        gid = int(v["group"]["group_id"], 16) if v.get("group") else None
        for rank in v["ranks"]:
            b = boards.ranks.get(rank)
            if b is None:
                continue
            slots = [i for i, g in enumerate(b.groups) if g.group_id == gid]
            out.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": f"{v['kind']} ({v['cause']})",
                    "cat": "verdict",
                    "pid": rank,
                    "tid": slots[0] + 1 if slots else STEPS_TID,
                    "ts": round(at * 1e6, 3),
                    "args": {
                        "ranks": v["ranks"],
                        "op": v.get("op"),
                        "trace_id": v.get("trace_id"),
                        "detected_s": v.get("detected_s"),
                        "evidence": [e["text"] for e in v.get("evidence", [])],
                    },
                }
            )
    return out


def write_trace(
    boards: JobBoards, verdicts: Iterable[dict], path: Path, *, replace: bool = True
) -> int:
    """Write the timeline to ``path``, in a folder that exists; the number of events. A
    file there is replaced where ``replace`` (a command's own output), else refused."""
    events = trace_events(boards, verdicts)
    data = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode()
    replace_file(path, data, force=replace)
    return len(events)
