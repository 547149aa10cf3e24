"""``ccld trace``: the timeline of a job's boards, as Trace Event JSON."""

from __future__ import annotations

import json

from builders import S, group, rank_board
from trace_rules import check_trace

from ccld_plugin.postmortem.boards import JobBoards
from ccld_plugin.postmortem.timeline import STEPS_TID, write_trace
from ccld_plugin.wire.codes import FLAG_P2P, FLAG_SEND

TP = group("tp", (0, 1))
PP = group("pp", (0, 2))


def _op(seq, enter_s, exit_s=None, **kw):
    return dict(seq=seq, enter_ns=int(enter_s * S), exit_ns=exit_s and int(exit_s * S), **kw)


def _boards():
    r0 = rank_board(
        0,
        3,
        [TP, PP],
        [
            _op(1, 1.0, 1.2, step=1),
            _op(2, 2.0, 2.1, step=2),
            _op(1, 2.2, 2.3, slot=1, op="send", step=2),
            _op(3, 3.0, step=3),
        ],
        heartbeat_ns=10 * S,
        step=3,
    )
    r1 = rank_board(
        1, 3, [TP], [_op(1, 1.1, 1.2, step=1), _op(2, 2.05, 2.1, step=2)], heartbeat_ns=10 * S
    )
    r2 = rank_board(2, 3, [PP], [_op(1, 2.25, 2.3, slot=0, op="recv", step=2)], heartbeat_ns=10 * S)
    # the send's and the receive's peers (the builder leaves P2P fields to the test)
    r0.snap.ops["flags"][2], r0.snap.ops["peer"][2] = FLAG_P2P | FLAG_SEND, 2
    r2.snap.ops["flags"][0], r2.snap.ops["peer"][0] = FLAG_P2P, 0
    return JobBoards("j", 3, {0: r0, 1: r1, 2: r2})


def test_timeline_follows_the_trace_event_rules(tmp_path):
    hang = {
        "kind": "hang",
        "cause": "compute",
        "ranks": [1],
        "group": TP.to_dict(),
        "op": "all_reduce",
        "trace_id": f"{TP.group_id:016x}:3",
        "onset_s": 2.1,
        "detected_s": 9.0,
        "evidence": [{"fact": "not_entered", "text": "rank 1 has not entered", "data": {}}],
    }
    n = write_trace(_boards(), [hang], tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    assert len(doc["traceEvents"]) == n
    by_ph = check_trace(doc)
    names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in by_ph["M"] if e["name"] == "thread_name"
    }
    assert names[(0, 1)] == "tp[0, 1]" and names[(0, 2)] == "pp[0, 2]"
    assert names[(0, STEPS_TID)] == "steps"
    tid = f"{TP.group_id:016x}"
    ar = [e for e in by_ph["X"] if e["name"] == f"all_reduce tp {tid}:2"]
    assert sorted(e["pid"] for e in ar) == [0, 1]
    # the hung all-reduce on rank 0 lasts until the rank's last sign of life
    (stuck,) = [e for e in by_ph["X"] if e["name"] == f"all_reduce tp {tid}:3"]
    assert (stuck["ts"], stuck["dur"], stuck["args"]["state"]) == (3e6, 7e6, "in_flight")
    # one flow per collective of two ranks (seqs 1, 2) and one for the send -> recv
    starts = sorted((e["pid"], e["ts"]) for e in by_ph["s"])
    assert starts == [(0, 1e6), (0, 2e6), (0, 2.2e6)]  # the first to enter
    steps = [e["name"] for e in by_ph["X"] if e["pid"] == 0 and e["tid"] == STEPS_TID]
    assert steps == ["step 1", "step 2", "step 3"]
    (v,) = by_ph["i"]
    assert (v["pid"], v["tid"], v["ts"], v["name"]) == (1, 1, 2.1e6, "hang (compute)")
