"""Fuzzing the post-mortem commands (hypothesis) over real boards and recordings, mutated:
flipped bytes and extreme values in headers, offsets, op, channel and group records and
the rank pool, and rounds of a recording with fields of other types and ranges. What
``ccld inspect``, ``diagnose``, ``trace`` and ``replay`` run either succeeds or raises one
of the commands' own one-line errors, never anything else (no OverflowError, no numpy
overflow warning), and ``main`` returns 0, 1 or 2."""

from __future__ import annotations

import json
import pickle
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from builders import S, group, rank_summary
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ccld_plugin import _native
from ccld_plugin.board.job_files import write_stack
from ccld_plugin.board.reader import (
    CHANNEL_DTYPE,
    GROUP_DTYPE,
    HEADER_DTYPE,
    OP_DTYPE,
    BoardError,
)
from ccld_plugin.cli import main
from ccld_plugin.config import ConfigError, load_config, to_yaml
from ccld_plugin.postmortem.boards import JobBoards, PostmortemError, load_boards
from ccld_plugin.postmortem.diagnose_boards import diagnose_boards
from ccld_plugin.postmortem.inspect_boards import collective_table, inspect_all
from ccld_plugin.postmortem.replay import replay
from ccld_plugin.postmortem.timeline import trace_events
from ccld_plugin.postmortem.verdict_files import read_verdict_file, verdict_problem
from ccld_plugin.recording import RecordedRound, RecordingError, RoundRecorder
from ccld_plugin.topology import group_id_of, role_index
from ccld_plugin.wire.codes import FLAG_P2P, FLAG_SEND, OP_CODES, SOURCE_NCCL, SOURCE_TCP
from ccld_plugin.wire.summary import GroupProgress, InFlightOp, encode_summary

# The same examples on every run (a CI run passes or fails on the code, not on the draw),
# a bounded number of them, and no deadline: a post-mortem of a mutated job takes tens of
# milliseconds here, more on a loaded machine.
settings.register_profile(
    "postmortem-fuzz",
    derandomize=True,
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FUZZ = settings.get_profile("postmortem-fuzz")

OWN_ERRORS = (BoardError, PostmortemError, RecordingError, ConfigError)
CFG = load_config(None, ["diagnoser.hang_min_s=0.5"], writing=False)
WORLD = 2
DP = group("dp", range(WORLD))
RING, GROUPS, CHANNELS, POOL = 16, 4, 4, 16


def _write_job(folder: Path) -> Path:
    """Two ranks' boards: completed, in-flight and point-to-point ops, a TCP and an NCCL
    channel record, a clock offset, and a stack beside rank 0's board."""
    folder.mkdir()
    for r in range(WORLD):
        path = folder / f"rank{r}.board"
        b = _native.Board(str(path), r, WORLD, "j", socket.gethostname(), RING, GROUPS, 4, POOL)
        g = b.register_group(group_id_of(DP.ranks), role_index("dp"), list(DP.ranks), r)
        b.set_clock_offset(1000 * r)
        b.set_step(2)
        for _ in range(4):
            b.exit(b.enter(g, OP_CODES["all_reduce"], 0, 4096), 2)
        send = FLAG_P2P | (FLAG_SEND if r == 0 else 0)
        b.exit(b.enter_p2p(g, OP_CODES["send" if r == 0 else "recv"], send, 64, 1 - r, 1), 2)
        if r == 0:
            b.enter(g, OP_CODES["all_reduce"], 0, 4096)  # rank 1 never enters it
        now = _native.now_ns()
        tcp = b.channel_claim(SOURCE_TCP)
        b.channel_write(tcp, peer=1 - r, bytes_queued=100, first_ns=now, last_progress_ns=now)
        nccl = b.channel_claim(SOURCE_NCCL)
        b.channel_write(nccl, peer=1 - r, steps_posted=4, steps_done=1, last_progress_ns=now)
        b.heartbeat()
        b.close(unlink=False)
    write_stack(folder / "rank0.board", ["train.py:10 in step"])
    return folder


# ------------------------------------------------------------------ board mutations

TABLES = {  # name: (record dtype, its header offset field, records in the table)
    "header": (HEADER_DTYPE, None, 1),
    "group": (GROUP_DTYPE, "groups_off", GROUPS),
    "op": (OP_DTYPE, "ring_off", RING),
    "channel": (CHANNEL_DTYPE, "channels_off", CHANNELS),
}
EXTREMES = [
    0,
    1,
    -1,
    2**31 - 1,
    -(2**31),
    2**32 - 1,
    2**47,
    2**48,
    2**60,
    2**60 + 1,
    2**62,
    2**63 - 1,
    -(2**63) + 1,
    2**63,
    2**64 - 1,
]


@st.composite
def field_sets(draw: st.DrawFn) -> tuple[str, int, str, int]:
    """(table, record index, field, value): one field of one record set to a value."""
    table = draw(st.sampled_from(sorted(TABLES)))
    dtype, _, count = TABLES[table]
    name = draw(st.sampled_from([n for n in dtype.names if dtype.fields[n][0].kind in "iu"]))
    value = draw(st.sampled_from(EXTREMES) | st.integers(-(2**63), 2**64 - 1))
    return table, draw(st.integers(0, count - 1)), name, value


MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**5), st.integers(1, 255)),
    st.tuples(st.just("set"), field_sets()),
    st.tuples(st.just("pool"), st.integers(0, POOL - 1), st.sampled_from(EXTREMES)),
)


def _set(data: bytearray, at: int, ftype: np.dtype, value: int) -> None:
    """``value`` stored at ``at`` in ``ftype``'s width, wrapped as a C store would."""
    bits = 8 * ftype.itemsize
    raw = np.array([value % (1 << bits)], dtype=f"<u{ftype.itemsize}")
    data[at : at + ftype.itemsize] = raw.view(ftype.newbyteorder("<")).tobytes()


def _mutate(board: Path, mutations: list[tuple]) -> None:
    data = bytearray(board.read_bytes())
    header = np.frombuffer(bytes(data[: HEADER_DTYPE.itemsize]), HEADER_DTYPE)[0]
    for m in mutations:
        if m[0] == "flip":
            data[m[1] % len(data)] ^= m[2]
        elif m[0] == "set":
            table, index, name, value = m[1]
            dtype, offset_field, _ = TABLES[table]
            base = int(header[offset_field]) if offset_field else 0
            ftype, at = dtype.fields[name][0], dtype.fields[name][1]
            _set(data, (base + index * dtype.itemsize + at) % len(data), ftype, value)
        else:
            at = int(header["rank_pool_off"]) + 4 * m[1]
            _set(data, at % len(data), np.dtype("<i4"), m[2])
    board.write_bytes(bytes(data))


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err
    assert all(line.startswith("ccld: ") for line in err.splitlines() if line), err


@pytest.mark.filterwarnings("error")  # a numpy overflow is a failure, not garbage
@FUZZ
@given(
    st.sampled_from(range(WORLD)),
    st.lists(MUTATION, min_size=1, max_size=6),
)
def test_a_mutated_job_is_read_or_refused_in_one_line(tmp_path_factory, capsys, rank, mutations):
    folder = _write_job(tmp_path_factory.mktemp("fuzz") / "j")
    _mutate(folder / f"rank{rank}.board", mutations)

    # the library behind the commands
    try:
        inspect_all(folder)
        collective_table(folder)
    except OWN_ERRORS as exc:
        assert "\n" not in str(exc)
    try:
        boards = load_boards(folder)
    except OWN_ERRORS as exc:
        assert "\n" not in str(exc)
    else:
        verdicts = [v.to_dict() for v in diagnose_boards(boards, CFG)]
        assert all(verdict_problem(v) is None for v in verdicts)  # --verdicts reads them
        json.dumps(trace_events(boards, verdicts), allow_nan=False)

    # the commands
    out = folder.parent / "trace.json"
    for argv in (
        ["inspect", str(folder), "--json"],
        ["diagnose", str(folder), "--jsonl", str(folder.parent / "v.jsonl")],
        ["trace", str(folder), "-o", str(out), "--force"],
    ):
        assert main(argv) in (0, 1, 2)
        _no_traceback(capsys.readouterr().err)


# ------------------------------------------------------------------ recording mutations


def _write_recording(path: Path) -> Path:
    """Rounds of a DP pair whose rank 1 stops in compute."""
    rec = RoundRecorder(path, to_yaml(CFG))
    for t in range(89, 96):
        stuck = [InFlightOp(0, OP_CODES["all_reduce"], 0, -1, 8, 64, 88 * S)]
        summaries = [
            rank_summary(
                0,
                t * S,
                last_progress_ns=88 * S,
                groups=[GroupProgress(0, 8, 7, 0, 0, 0, 0)],
                in_flight=stuck,
            ),
            rank_summary(
                1, t * S, last_progress_ns=88 * S, groups=[GroupProgress(0, 7, 7, 0, 0, 0, 0)]
            ),
        ]
        values = {s.rank: encode_summary(s) for s in summaries}
        rec.write(RecordedRound(t * S, 0, WORLD, values, {0: [DP], 1: [DP]}, observer=0))
    rec.close()
    return path


def _frames(path: Path) -> list[Any]:
    out = []
    with open(path, "rb") as f:
        while True:
            try:
                out.append(pickle.load(f))
            except EOFError:
                return out


HOSTILE = st.sampled_from(
    [
        None,
        -1,
        2**70,
        -(2**70),
        1.5,
        float("nan"),
        True,
        "x",
        b"\x03" * 40,
        [],
        {},
        (1,),
        {0: "x"},
        {-1: b""},
        {"a": b""},
        [(1, "dp", (0, 1))],
        {0: [(2**64, "dp", (0, 1))]},
        {0: [(1, "nope", (0, 1))]},
        {0: [(1, "dp", (0, 2**40))]},
        (2**61, 0),
    ]
)
FRAME_MUTATION = st.one_of(
    st.tuples(st.just("value"), st.integers(0, 7), st.text(max_size=20), HOSTILE),
    st.tuples(
        st.just("field"),
        st.integers(0, 7),
        st.sampled_from([f.name for f in RecordedRound.__dataclass_fields__.values()]),
        HOSTILE,
    ),
    st.tuples(st.just("summary"), st.integers(0, 7), st.integers(0, 1), st.binary(max_size=80)),
    st.tuples(st.just("flip"), st.integers(0, 10**5), st.integers(1, 255)),
)


def _mutate_recording(path: Path, mutations: list[tuple]) -> None:
    frames = _frames(path)
    flips = []
    for m in mutations:
        if m[0] == "flip":
            flips.append(m[1:])
            continue
        frame = frames[1 + m[1] % (len(frames) - 1)]  # a round, after the head
        if m[0] == "summary":
            if isinstance(frame.get("values"), dict):
                frame["values"][m[2]] = m[3]
        else:
            frame[m[2]] = m[3]
    data = bytearray(b"".join(pickle.dumps(f) for f in frames))
    for at, xor in flips:
        data[at % len(data)] ^= xor
    path.write_bytes(bytes(data))


@pytest.mark.filterwarnings("error")
@FUZZ
@given(st.lists(FRAME_MUTATION, min_size=1, max_size=4))
def test_a_mutated_recording_is_replayed_or_refused_in_one_line(
    tmp_path_factory, capsys, mutations
):
    path = _write_recording(tmp_path_factory.mktemp("rec") / "rounds.rec")
    _mutate_recording(path, mutations)
    try:
        _, verdicts = replay(path)
        assert all(verdict_problem(v.to_dict()) is None for v in verdicts)
    except OWN_ERRORS as exc:
        assert "\n" not in str(exc)
    assert main(["replay", str(path)]) in (0, 1, 2)
    _no_traceback(capsys.readouterr().err)


# ------------------------------------------------------------------ verdicts files

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
RECORD_KEYS = ["kind", "cause", "ranks", "group", "onset_s", "detected_s", "op", "trace_id"]
RECORD = st.fixed_dictionaries(
    {},
    optional={
        k: JSON | st.sampled_from(["hang", "compute", [1], {"group_id": "ff"}, 1.5])
        for k in [*RECORD_KEYS, "evidence", "schema"]
    },
)


@pytest.fixture(scope="module")
def job_boards(tmp_path_factory: pytest.TempPathFactory) -> JobBoards:
    return load_boards(_write_job(tmp_path_factory.mktemp("boards") / "j"))


@FUZZ
@given(
    st.lists(
        st.one_of(RECORD.map(json.dumps), JSON.map(json.dumps), st.text(max_size=20)),
        max_size=5,
    ),
    st.booleans(),
)
@example(['{"kind": [], "cause": {}}'], False)  # a set lookup of a list raised TypeError
def test_a_verdicts_file_is_read_or_refused_in_one_line(tmp_path_factory, job_boards, lines, torn):
    path = tmp_path_factory.mktemp("verdicts") / "v.jsonl"
    path.write_text("\n".join(lines) + ("" if torn else "\n"))
    try:
        records, left_out = read_verdict_file(path)
    except PostmortemError as exc:
        assert "\n" not in str(exc)
        return
    assert all(verdict_problem(v) is None for v in records)
    assert left_out is None or "\n" not in left_out
    json.dumps(trace_events(job_boards, records), allow_nan=False)  # what trace does
