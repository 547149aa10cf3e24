"""Device time on the wire and in the harness's options: a summary of device time keeps its
sources and each step's host compute through both decoders (and an earlier version's value
still decodes as host time); the device faults parse and are refused without the
simulated device."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from builders import NOW, S, rank_board, rank_summary

from ccld_harness.faults import FaultSpecError, parse_fault
from ccld_harness.options import DemoError, DemoOptions, checked_options
from ccld_harness.outcome import expected_verdict
from ccld_plugin.agent.board_summary import final_summary
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.codes import FLAG_CUDA, FLAG_DEVICE, TIME_EVENTS, TIME_HOST, TIME_WORK
from ccld_plugin.wire.summary import (
    GroupProgress,
    InFlightOp,
    StepStat,
    SummaryError,
    decode_summary,
    encode_summary,
    upgraded_summary,
)
from ccld_plugin.wire.summary_batch import SummaryTable

DEVICE = TIME_EVENTS | TIME_WORK << 4  # compute from device events, arrivals from work timing


def _device_summary(rank: int):
    s = rank_summary(
        rank,
        groups=[GroupProgress(0, 12, 11, 3, 40, 1 << 20, 900)],
        in_flight=[InFlightOp(0, 1, FLAG_CUDA | FLAG_DEVICE, -1, 12, 4096, NOW - 2 * S)],
        steps=[StepStat(k, NOW - k * S, 900_000, 300_000 + rank, 0, 850_000) for k in range(3)],
    )
    s.time_source = DEVICE
    return s


def test_a_summary_of_device_time_keeps_its_sources_and_host_compute():
    s = _device_summary(1)
    back = decode_summary(encode_summary(s))
    assert back.time_source == DEVICE and back.flags == s.flags
    assert back.steps == s.steps  # the device's compute, the host's beside it
    assert dataclasses.replace(back, sample_rows=b"", p2p_rows=b"") == s
    table, bad = SummaryTable.decode({1: encode_summary(s), 2: encode_summary(_device_summary(2))})
    assert not bad
    assert table.steps["compute_us"].tolist() == [300_001] * 3 + [300_002] * 3
    assert set(table.steps["host_compute_us"].tolist()) == {850_000}
    assert set(table.steps["cpu_wait_us"].tolist()) == {0}


def test_a_host_summary_is_as_before_and_an_earlier_version_decodes_as_host_time():
    s = rank_summary(0, steps=[StepStat(4, NOW - S, 900_000, 600_000, 20_000)])
    data = encode_summary(s)
    back = decode_summary(data)
    assert back.time_source == TIME_HOST and back.steps == s.steps
    table, _ = SummaryTable.decode({0: data})
    assert table.steps["cpu_wait_us"].tolist() == [20_000]
    assert table.steps["host_compute_us"].tolist() == [0]
    old = b"\x03" + data[1:]  # version 3: the same records, no device time
    assert decode_summary(upgraded_summary(old)).steps == s.steps


def test_a_summary_made_from_a_ranks_board_keeps_its_steps_clock():
    # a node's leader tells a rank whose agent fell silent from its board, with the steps
    # of its last summary: their figures are the device's, and stay so
    last = _device_summary(1)
    board = rank_board(1, 2, [GroupInfo(0xD0, "dp", (0, 1))], heartbeat_ns=NOW - S)
    made = final_summary(board.snap, last, died=False)
    assert made.time_source == DEVICE and made.steps == last.steps
    assert decode_summary(encode_summary(made)).steps == last.steps


def test_a_summary_with_an_unknown_arrival_source_is_refused():
    s = _device_summary(1)
    s.time_source = TIME_EVENTS | 7 << 4
    with pytest.raises(SummaryError, match="flags"):
        decode_summary(encode_summary(s))


def test_device_faults_parse_and_expect_compute_verdicts():
    slow = parse_fault("device-slow@2:factor=2,step=6")
    assert (slow.kind, slow.rank, slow.factor, slow.step) == ("device-slow", 2, 2.0, 6)
    assert slow.is_device and not slow.is_comm and parse_fault(str(slow)) == slow
    hang = parse_fault("device-hang@1")
    assert hang.is_device and str(hang) == "device-hang@1:step=3"
    assert expected_verdict(slow) == ("slow", "compute")
    assert expected_verdict(hang) == ("hang", "compute")
    with pytest.raises(FaultSpecError, match="factor"):
        parse_fault("device-slow@2")
    with pytest.raises(FaultSpecError, match=r"factor must be in \(1, 100\]"):
        parse_fault("device-slow@2:factor=1")


def test_the_simulated_device_is_asked_for_with_the_torch_workload(tmp_path: Path):
    opts = DemoOptions(framework="torch", world=2, tp=1, pp=2, out=tmp_path / "o")
    with pytest.raises(DemoError, match="add --device sim"):
        checked_options(dataclasses.replace(opts, faults=["device-hang@1:step=3"]))
    with pytest.raises(DemoError, match="use --framework torch"):
        checked_options(dataclasses.replace(opts, framework="megatron", device="sim"))
    with pytest.raises(DemoError, match="expected cpu or sim"):
        checked_options(dataclasses.replace(opts, device="gpu"))
    sim = dataclasses.replace(opts, device="sim", faults=["device-slow@1:factor=2"])
    assert [f.kind for f in checked_options(sim)] == ["device-slow"]
