"""The verdict record: evidence rendered from its data, the JSON line a verdict becomes,
and verdicts files of schema 1 (evidence as sentences) read in the current shape."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
from builders import group

from ccld_plugin.diagnose.records import VERDICT_SCHEMA_VERSION, Cause, Evidence, Kind, Verdict
from ccld_plugin.sinks.console import render_verdict
from ccld_plugin.sinks.jsonl import JsonlSink, read_verdicts, upgraded
from ccld_plugin.sinks.wandb.verdicts import alert_message

TEMPLATE = (
    "rank {rank} -> {peer}: {queued:bytes} queued for {stalled_s:.1f} s, window closed "
    "{closed:.0%}, {ratio:.0f}x its siblings, on {roles:join(/)} links {link[0]}<->{link[1]}"
)


def test_evidence_text_is_rendered_from_its_data_as_plain_json() -> None:
    e = Evidence.of(
        "link_stalled",
        TEMPLATE,
        rank=np.int64(1),
        peer=2,
        queued=1_234_567,
        stalled_s=np.float64(4.04999),
        closed=0.456,
        ratio=20.4,
        roles=("dp", "tp"),
        link=(1, 2),
    )
    assert e.text == (
        "rank 1 -> 2: 1.2 MB queued for 4.0 s, window closed 46%, 20x its siblings, on dp/tp "
        "links 1<->2"
    )
    # Floats at the precision the sentence shows (a whole number where it shows none),
    # numpy scalars and tuples as JSON values.
    assert e.data == {
        "rank": 1,
        "peer": 2,
        "queued": 1_234_567,
        "stalled_s": 4.0,
        "closed": 0.46,
        "ratio": 20,
        "roles": ["dp", "tp"],
        "link": [1, 2],
    }
    assert type(e.data["rank"]) is int and type(e.data["ratio"]) is int
    # The data says what the sentence says: rendering it again gives the same sentence.
    assert Evidence.of(e.fact, TEMPLATE, **e.data).text == e.text
    assert json.loads(json.dumps(e.to_dict())) == {
        "fact": "link_stalled",
        "text": e.text,
        "data": e.data,
    }
    assert [Evidence.of("b", "{n:bytes}", n=n).text for n in (12, 1000, 999_999, 10**6)] == [
        "12 B",
        "1.0 KB",
        "1000.0 KB",
        "1.0 MB",
    ]
    with pytest.raises(TypeError):
        Evidence.of("bad", "{x}", x=object())


def _verdict() -> Verdict:
    v = Verdict(
        kind=Kind.HANG,
        cause=Cause.COMPUTE,
        ranks=[2],
        group=group("tp", [2, 3]).to_dict(),
        op="all_reduce",
        step=5,
        detected_s=14.0,
        severity=5.2,
        evidence=[
            Evidence.of(
                "in_no_collective",
                "rank {rank} is in no collective; no progress for {idle_s:.1f} s (step {step})",
                rank=2,
                idle_s=5.24,
                step=5,
            )
        ],
    )
    v.stamp("j", 0, datetime(2026, 12, 7, tzinfo=timezone.utc))
    return v


def test_verdict_record_carries_each_item_as_fact_text_and_data() -> None:
    d = _verdict().to_dict()
    assert d["schema"] == VERDICT_SCHEMA_VERSION == 3
    assert d["evidence"] == [
        {
            "fact": "in_no_collective",
            "text": "rank 2 is in no collective; no progress for 5.2 s (step 5)",
            "data": {"rank": 2, "idle_s": 5.2, "step": 5},
        }
    ]
    assert list(d["evidence"][0]) == ["fact", "text", "data"]
    assert json.loads(json.dumps(d)) == d


NEW_IN_3 = ("culprits", "time", "job", "id", "resumes", "ratio", "stuck_s", "lasted_s")


def _written_by(schema: int, record: dict) -> dict:
    """``record`` as a writer of ``schema`` (1 or 2) wrote it: one ``severity``, no who
    and where, and (1) evidence as sentences."""
    old = {k: v for k, v in record.items() if k not in NEW_IN_3}
    old.update(schema=schema, severity=record["stuck_s"])
    if schema == 1:
        old["evidence"] = [e["text"] for e in record["evidence"]]
    return old


def test_records_of_schema_1_and_2_are_read_in_the_current_shape(tmp_path: Path) -> None:
    path = tmp_path / "verdicts.jsonl"
    now = _verdict().to_dict()
    one, two = _written_by(1, now), _written_by(2, now)
    path.write_text(json.dumps(one) + "\n" + json.dumps(two) + "\n")
    sink = JsonlSink(path)
    sink.emit(_verdict())
    sink.close()
    with path.open("a") as fh:
        fh.write('{"kind": "hang", "torn')  # the writer died mid-line
    first, second, third = read_verdicts(path)
    # a hang's severity was its seconds stuck; who and where were not written: not known
    unknown = {"time": None, "job": None, "id": None, "resumes": None}
    culprits = [{"rank": 2, "host": None, "local_rank": None, "device": None}]
    measures = {"ratio": None, "stuck_s": 5.2, "lasted_s": None}
    notes = [{"fact": "note", "text": e["text"], "data": {}} for e in now["evidence"]]
    assert first == {**now, **unknown, "culprits": culprits, **measures, "schema": 1} | {
        "evidence": notes
    }
    assert second == {**now, **unknown, "culprits": culprits, **measures, "schema": 2}
    assert third == now
    # The sinks show the sentences, whichever schema the record was written in.
    shown = "- rank 2 is in no collective; no progress for 5.2 s (step 5)"
    for record in (first, second, third):
        assert shown in render_verdict(record).plain and shown in alert_message(record)["text"]
    # a slow verdict's severity was its ratio
    slow = _written_by(2, {**now, "kind": "slow", "stuck_s": 1.7})
    assert upgraded(slow)["ratio"] == 1.7 and slow["stuck_s"] is None


def test_a_lost_rank_is_one_finding_whatever_op_it_was_last_seen_in():
    dp, tp = group("dp", [0, 1, 2, 3]), group("tp", [2, 3])

    def lost(g, step):
        return Verdict(
            kind=Kind.UNRESPONSIVE,
            cause=Cause.UNKNOWN,
            ranks=[2],
            group=g.to_dict() if g else None,
            step=step,
        )

    # its last summary had it in a DP all-reduce; the one its node brought after its death,
    # in no op (or in a TP one): the same rank lost, told once
    assert lost(dp, 4).key() == lost(None, 6).key() == lost(tp, 6).key()
    hang = Verdict(kind=Kind.HANG, cause=Cause.COMPUTE, ranks=[2], group=dp.to_dict())
    assert (
        hang.key()
        != Verdict(kind=Kind.HANG, cause=Cause.COMPUTE, ranks=[2], group=tp.to_dict()).key()
    )


def test_alert_levels_follow_the_kind() -> None:
    # W&B alerts: ERROR for a stuck job, INFO for a hang that resumed, WARN for the rest.
    hang = _verdict().to_dict()
    levels = {
        kind: alert_message({**hang, "kind": kind})["level"] for kind in ("hang", "resumed", "slow")
    }
    assert levels == {"hang": "ERROR", "resumed": "INFO", "slow": "WARN"}
    assert render_verdict({**hang, "kind": "resumed"}).plain.startswith("[ccld] RESUMED ")
