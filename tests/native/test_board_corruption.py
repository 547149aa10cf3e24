"""Corrupt boards: a header that is impossible is refused with one line, records that fail
their checks are counted and left out, never shown as data (``ccld inspect`` says so and
exits 1); and a fuzz test of the reader over damaged board files."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ccld_plugin import _native
from ccld_plugin.board.reader import (
    GROUP_DTYPE,
    HEADER_DTYPE,
    MAX_COUNT,
    OP_DTYPE,
    BoardError,
    BoardReader,
)
from ccld_plugin.postmortem.inspect_boards import collective_table, inspect_all, rank_status
from ccld_plugin.topology import group_id_of, role_index
from ccld_plugin.wire.codes import FLAG_P2P, FLAG_SEND, OP_CODES, OP_NAMES, SOURCE_TCP

WORLD, RANK = 4, 1
HEADER = {name: HEADER_DTYPE.fields[name][1] for name in HEADER_DTYPE.names}


def _write_board(path: Path) -> Path:
    """A board as a rank writes it: two groups, completed, in-flight and P2P ops, and a
    TCP channel with bytes queued."""
    b = _native.Board(str(path), RANK, WORLD, "job", socket.gethostname(), 64, 8, 8, 64)
    world = b.register_group(group_id_of((0, 1, 2, 3)), role_index("world"), [0, 1, 2, 3], 1)
    tp = b.register_group(group_id_of((0, 1)), role_index("tp"), [0, 1], 1)
    b.set_step(7)
    for _ in range(10):
        b.exit(b.enter(tp, OP_CODES["all_reduce"], 0, 4096), 2)
    b.enter(world, OP_CODES["all_reduce"], 0, 1 << 20)  # in flight
    b.exit(b.enter_p2p(tp, OP_CODES["send"], FLAG_P2P | FLAG_SEND, 128, 0, 1), 2)
    now = time.monotonic_ns()
    slot = b.channel_claim(SOURCE_TCP)
    b.channel_write(slot, peer=0, bytes_queued=1000, first_ns=now, last_progress_ns=now)
    b.close(unlink=False)
    return path


@pytest.fixture
def board(tmp_path: Path) -> Path:
    return _write_board(tmp_path / "rank1.board")


def _header_offset(name: str) -> int:
    return HEADER[name]


def _ring_offset(path: Path) -> int:
    with BoardReader(path) as r:
        return int(r._hdr[0]["ring_off"])


def _inspect(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ccld_plugin.cli", "inspect", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_sound_board_has_no_corrupt_records(board):
    (status,) = inspect_all(board).statuses
    assert status.corrupt_records == {}
    assert len(status.groups) == 2 and len(status.in_flight) == 1
    assert _inspect(board).returncode == 0


def test_flipped_bytes_in_op_records_are_counted_and_not_shown(board):
    data = bytearray(board.read_bytes())
    ring = _ring_offset(board)
    size_at = OP_DTYPE.fields["bytes"][1]
    for i in range(12):  # every record's byte count, in exabytes
        data[ring + i * OP_DTYPE.itemsize + size_at + 7] ^= 0x40
    board.write_bytes(bytes(data))
    out = _inspect(board, "--json")
    assert out.returncode == 1
    (warning,) = out.stderr.strip().splitlines()
    assert "corrupt records left out (12 ops)" in warning
    (status,) = json.loads(out.stdout)
    assert status["corrupt_records"] == {"ops": 12} and status["in_flight"] == []
    assert all(row.bytes < MAX_COUNT for row in collective_table(board))
    text = _inspect(board)
    assert text.returncode == 1 and "12 ops" in text.stdout


def test_a_group_with_impossible_ranks_takes_its_ops_with_it(board):
    data = bytearray(board.read_bytes())
    with BoardReader(board) as r:
        pool = int(r._hdr[0]["rank_pool_off"])
    data[pool + 4 * 5 : pool + 4 * 6] = (99).to_bytes(4, "little", signed=True)  # tp's rank 1
    board.write_bytes(bytes(data))
    with BoardReader(board) as r:
        status = rank_status(r)
    assert [g["role"] for g in status.groups] == ["world"]
    assert status.corrupt_records == {"groups": 1, "ops": 11}
    assert [f.group_role for f in status.in_flight] == ["world"]


@pytest.mark.parametrize(
    "field, value",
    [("world", 0), ("rank", 9), ("ring_off", 4096), ("num_groups", 9999), ("step", -5)],
)
def test_an_impossible_header_is_refused_in_one_line(board, field, value):
    data = bytearray(board.read_bytes())
    width = HEADER_DTYPE.fields[field][0].itemsize
    data[_header_offset(field) : _header_offset(field) + width] = value.to_bytes(
        width, "little", signed=True
    )
    board.write_bytes(bytes(data))
    with pytest.raises(BoardError, match="corrupt header"):
        BoardReader(board)
    out = _inspect(board)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_one_bad_board_in_a_folder_does_not_hide_the_others(tmp_path):
    good = _write_board(tmp_path / "rank1.board")
    bad = tmp_path / "rank2.board"
    data = bytearray(good.read_bytes())
    data[_header_offset("world") : _header_offset("world") + 4] = bytes(4)
    bad.write_bytes(bytes(data))
    out = _inspect(tmp_path, "--json")
    assert out.returncode == 1
    assert [s["path"] for s in json.loads(out.stdout)] == [str(good)]
    assert "rank2.board: corrupt header" in out.stderr


def _plausible(path: Path) -> None:
    """What the reader returns from a damaged board is either refused or possible."""
    try:
        reader = BoardReader(path)
    except BoardError as exc:
        assert "\n" not in str(exc)
        return
    with reader:
        h = reader.header()
        status = rank_status(reader)
        ops = reader.ops()
        span_s = (time.monotonic_ns() - h.start_mono_ns) / 1e9 + 2
    assert 0 <= h.rank < h.world and h.step >= 0
    assert np.all(ops["bytes"] < MAX_COUNT) and np.all(ops["seq"] >= 1)
    assert {int(o) for o in ops["op"]} <= set(OP_NAMES)
    for g in status.groups:
        assert all(0 <= r < h.world for r in g["ranks"]) and h.rank in g["ranks"]
    for f in status.in_flight:
        assert f.op in OP_NAMES.values() and 0 <= f.age_s <= span_s
        assert all(0 <= r < h.world for r in f.group_ranks)
    for c in status.waiting_channels:
        assert c.peer is None or 0 <= c.peer < h.world
        assert 0 <= c.idle_s <= span_s and c.wait in ("none", "local", "peer", "network")
    for row in collective_table(path):
        assert row.bytes < MAX_COUNT and row.mean_duration_ms >= 0


FUZZ = settings(
    max_examples=120,
    deadline=5000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, 10**7), st.integers(1, 255)), min_size=1, max_size=12),
    st.booleans(),
)
def test_a_damaged_board_is_refused_or_read_as_possible(tmp_path_factory, flips, header_only):
    path = _write_board(Path(tmp_path_factory.mktemp("fuzz")) / "rank1.board")
    data = bytearray(path.read_bytes())
    region = HEADER_DTYPE.itemsize if header_only else len(data)
    for at, xor in flips:
        data[at % region] ^= xor
    path.write_bytes(bytes(data))
    _plausible(path)


@FUZZ
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_a_board_body_of_noise_is_all_left_out(tmp_path_factory, seed, tables):
    """Random bytes over whole tables (a header that still checks out): every record is
    counted as corrupt or dropped, and what is shown is possible."""
    path = _write_board(Path(tmp_path_factory.mktemp("noise")) / "rank1.board")
    data = bytearray(path.read_bytes())
    rng = random.Random(seed)
    start = int(np.frombuffer(data, HEADER_DTYPE, 1)[0]["groups_off"])
    end = start + tables * GROUP_DTYPE.itemsize * 8
    data[start:end] = rng.randbytes(end - start)
    path.write_bytes(bytes(data))
    _plausible(path)
