"""The diagnoser's batch decode (every rank's summary at once, into columns) reads what the
per-rank decoder reads, refuses what it refuses, and its channel rows are the per-rank
decoder's."""

from __future__ import annotations

import numpy as np
import pytest
from builders import MS, NOW, S, peer_channel, rank_summary

from ccld_plugin.wire.peer_channels import channel_rows, encode_channels
from ccld_plugin.wire.summary import (
    ArrivalSample,
    GroupProgress,
    InFlightOp,
    RankSummary,
    StepStat,
    SummaryError,
    decode_summary,
    encode_summary,
)
from ccld_plugin.wire.summary_batch import SummaryTable


def _busy(rank: int) -> RankSummary:
    """A summary with some of everything: groups, an op in flight, steps, samples, a
    stack, channel evidence (TCP and NCCL entries)."""
    channels = [
        peer_channel((rank + 1) % 4, sent=70_000, rtt_us=900),
        peer_channel((rank + 3) % 4, source="nccl", net_wait_us=7, direction="recv"),
    ]
    return rank_summary(
        rank,
        host=f"node{rank // 2}",
        groups=[
            GroupProgress(0, 12, 11, 3, 40, 1 << 20, 900),
            GroupProgress(1, 4, 4, 1, 5, 64, 50),
        ],
        in_flight=[InFlightOp(0, 1, 0, -1, 12, 4096, NOW - 2 * S)] if rank % 2 else [],
        steps=[StepStat(k, NOW - (9 - k) * S, 900_000, 600_000 + rank) for k in range(5, 9)],
        samples=[ArrivalSample(0, 11 - i, NOW - i * MS, 20 + rank, 1 << 20) for i in range(3)],
        stack=["train.py:10 in step", "model.py:4 in forward"] if rank == 3 else [],
        channels=encode_channels(channels, 1.0, 2) if rank != 2 else b"",
    )


def test_columns_and_lookups_match_the_per_rank_decoder() -> None:
    raw = {r: encode_summary(_busy(r)) for r in range(4)}
    table, bad = SummaryTable.decode(raw)
    assert bad == {} and list(table) == [0, 1, 2, 3]
    for r, value in raw.items():
        assert table[r] == decode_summary(value)
    assert [table.host(i) for i in range(4)] == [decode_summary(raw[r]).host for r in range(4)]
    one = decode_summary(raw[1])
    rows = table.groups[table.groups["row"] == 1]
    assert rows[["slot", "entered_seq", "completed_seq"]].tolist() == [
        (g.slot, g.entered_seq, g.completed_seq) for g in one.groups
    ]
    assert table.flights["row"].tolist() == [1, 3]
    steps = table.steps[table.steps["row"] == 1]
    assert steps["start_ns"].tolist() == [s.start_ns for s in one.steps]
    assert (
        len(table.samples) == 12
        and table.sample_rows.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    )
    # the columns of the same summaries as objects are the same
    objects = SummaryTable.of({r: decode_summary(v) for r, v in raw.items()})
    for name in ("heads", "groups", "flights", "steps", "samples"):
        assert np.array_equal(getattr(objects, name), getattr(table, name)), name


def test_channel_rows_match_the_per_rank_decoder() -> None:
    raw = {r: encode_summary(_busy(r)) for r in range(4)}
    table, _ = SummaryTable.decode(raw)
    expected = channel_rows(decode_summary(v) for v in raw.values())
    got = table.channel_rows()
    assert got.reports.tolist() == expected.reports.tolist()
    assert got.entries.tolist() == expected.entries.tolist()
    table.without_channels({1})
    assert sorted(set(table.channel_rows().reports["rank"].tolist())) == [0, 3]
    assert table[1].channels == b""


def test_what_the_per_rank_decoder_refuses_is_refused_alone() -> None:
    good = encode_summary(_busy(0))
    twice = _busy(1)
    twice.groups = [twice.groups[0], twice.groups[0]]
    late = _busy(2)
    late.heartbeat_ns = late.time_ns + 5 * S
    wrong_op = _busy(3)
    wrong_op.in_flight = [InFlightOp(0, 1, 0, 3, 12, 4096, NOW)]  # a collective with a peer
    values = {
        0: good,
        1: encode_summary(twice),
        2: encode_summary(late),
        3: encode_summary(wrong_op),
        4: good[:-3],  # torn
        5: b"\x01",
        6: good + b"x",
        7: bytes([9]) + good[1:],  # another version
        8: encode_summary(_busy(8)).replace(b"node4", b"\xffode4"),  # a host not UTF-8
    }
    table, bad = SummaryTable.decode(values)
    assert list(table) == [0]
    assert sorted(bad) == [1, 2, 3, 4, 5, 6, 7, 8]
    for rank in bad:
        with pytest.raises(SummaryError) as refused:
            decode_summary(values[rank])
        assert bad[rank] == str(refused.value)  # one codec: the same checks, the same reason


def test_a_table_of_a_selection_keeps_its_rows_own_records() -> None:
    raw = {r: encode_summary(_busy(r)) for r in range(4)}
    table, _ = SummaryTable.decode(raw)
    odd = table.select(np.array([False, True, False, True]))
    assert list(odd) == [1, 3] and 2 not in odd
    assert odd.flights["row"].tolist() == [0, 1]
    assert odd[3] == decode_summary(raw[3])
    assert odd.channel_rows().reports["rank"].tolist() == [1, 3]


def test_host_names_decode_as_the_per_rank_decoder_does() -> None:
    # runs of ranks on one host, a name with a newline (the names are decoded joined by
    # newlines), a name in more than ASCII, and one not UTF-8 (refused alone)
    hosts = ["node0", "node0", "a\nb", "a\nb", "knoten-ä", "node0", "node5"]
    raw = {r: encode_summary(rank_summary(r, host=h)) for r, h in enumerate(hosts)}
    raw[6] = raw[6].replace(b"node5", b"\xffode5")
    table, bad = SummaryTable.decode(raw)
    assert sorted(bad) == [6]
    assert [table.host(i) for i in range(len(table))] == hosts[:6]
    assert table.rows_on_hosts(lambda h: h == "node0").tolist() == [1, 1, 0, 0, 0, 1]
