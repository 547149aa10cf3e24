"""Interface tests of the NCCL profiler plugin (ccld_plugin/csrc/nccl_profiler.c).

These are unit tests of how the plugin handles NCCL's profiler interface (v4, v5, v6). They
are not tests against a real NCCL: there is no GPU and no NCCL here. A small C harness,
tests/nccl_harness.c, loads the plugin library the way NCCL does (dlopen by path, newest
``ncclProfiler_vN`` symbol first), creates the board through the same library, sets the
calling thread's trace id through ``ccld_op_enter`` as the tracer does, and replays event
streams shaped like NCCL's: Group/API/Coll/P2p events on the caller's thread, ProxyOp /
ProxyStep / KernelCh events on a proxy thread. The tests then read the board file back, as
an outside reader would. Whether real NCCL raises exactly these streams is not tested here.

The library and the harness are compiled with gcc from the checkout into a temporary
directory, so the tests need nothing but gcc (no pip install, no CMake build).
"""

from __future__ import annotations

import ctypes
import json
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from cbuild import compile_c
from paths import NATIVE_TESTS

HARNESS_SRC = NATIVE_TESTS / "nccl_harness.c"
VERSIONS = [4, 5, 6]

# board.h values
BOARD_MAGIC = 0x445241424C444343
SRC_NCCL = 1
SEND, RECV = 0, 1
NONE, LOCAL, PEER, NETWORK = 0, 1, 2, 3
NO_RANK = -1
TOTAL = 0xFF  # CCLD_CHANNEL_TOTAL

# ccld_channel, from board.h; test_board_layout_matches_header checks it against the C.
CHANNEL_DTYPE = np.dtype(
    {
        "names": [
            "lock",
            "source",
            "direction",
            "wait",
            "channel_id",
            "peer",
            "pid",
            "group_id",
            "seq",
            "steps_posted",
            "steps_done",
            "bytes_done",
            "first_ns",
            "last_progress_ns",
        ],
        "formats": [
            "<u4",
            "u1",
            "u1",
            "u1",
            "u1",
            "<i4",
            "<u4",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "<i8",
            "<i8",
        ],
        "offsets": [0, 4, 5, 6, 7, 8, 12, 16, 24, 32, 40, 48, 64, 72],
        "itemsize": 128,
    }
)
HEADER_OFFSETS = {"magic": 0, "max_channels": 44, "channels_off": 60, "errors": 264}


@dataclass(frozen=True)
class Build:
    lib: Path
    harness: Path
    compiler_output: str


@pytest.fixture(scope="module")
def build(probe_library: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Build:
    lib, output = probe_library
    harness = tmp_path_factory.mktemp("nccl_harness") / "nccl_harness"
    output += compile_c(harness, [HARNESS_SRC], "-Wall", "-Wextra", libs=("-ldl",))
    return Build(lib, harness, output)


def run(build: Build, scenario: str, board: Path | str = "-", version: int = 0, *args: int) -> dict:
    """Run one harness scenario; its JSON result, after the checks every scenario shares."""
    cmd = [str(build.harness), str(build.lib), str(version), scenario, str(board), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"harness {scenario} exited with {r.returncode}:\n{r.stderr}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bad_returns"] == 0, "a plugin function other than init returned non-zero"
    assert out["unwritten_handles"] == 0, "startEvent left *eHandle unwritten"
    return out


def channels(path: Path, totals: bool = False) -> list[dict[str, int]]:
    """Channel records in use, read from the board file: those of in-flight collectives,
    or (``totals``) the per-link totals records."""
    buf = path.read_bytes()
    assert struct.unpack_from("<Q", buf, HEADER_OFFSETS["magic"])[0] == BOARD_MAGIC
    (count,) = struct.unpack_from("<I", buf, HEADER_OFFSETS["max_channels"])
    (offset,) = struct.unpack_from("<I", buf, HEADER_OFFSETS["channels_off"])
    table = np.frombuffer(buf, CHANNEL_DTYPE, count=count, offset=offset)
    used = table[(table["source"] != 0) & ((table["channel_id"] == TOTAL) == totals)]
    assert (used["lock"] % 2 == 0).all(), "a record was left mid-write"
    return [{name: int(rec[name]) for name in CHANNEL_DTYPE.names} for rec in used]


def board_errors(path: Path) -> int:
    return struct.unpack_from("<Q", path.read_bytes(), HEADER_OFFSETS["errors"])[0]


def shape(rec: dict[str, int]) -> tuple[int, ...]:
    return (
        rec["channel_id"],
        rec["direction"],
        rec["peer"],
        rec["wait"],
        rec["steps_posted"],
        rec["steps_done"],
        rec["bytes_done"],
    )


# ----------------------------------------------------------------------------- build, ABI
def test_compiles_without_warnings(build: Build) -> None:
    assert build.compiler_output == "", build.compiler_output


def test_exports_every_version_and_newest_is_found_first(build: Build) -> None:
    lib = ctypes.CDLL(str(build.lib))
    for v in VERSIONS:
        assert ctypes.c_char_p.in_dll(lib, f"ncclProfiler_v{v}").value == b"ccld"
    assert run(build, "layout")["version"] == 6


@pytest.mark.parametrize("version", VERSIONS)
def test_activation_mask(build: Build, version: int) -> None:
    coll, p2p, proxy_op, proxy_step, kernel_ch, coll_api, p2p_api = 2, 4, 8, 16, 64, 512, 1024
    want = coll | p2p | proxy_op | proxy_step | kernel_ch
    if version >= 5:
        want |= coll_api | p2p_api
    assert run(build, "layout", version=version)["mask"] == want


def test_board_layout_matches_header(build: Build) -> None:
    out = run(build, "layout")
    assert out["channel_size"] == CHANNEL_DTYPE.itemsize
    for name in CHANNEL_DTYPE.names:
        assert out[f"ccld_channel.{name}"] == CHANNEL_DTYPE.fields[name][1], name
    for name, off in HEADER_OFFSETS.items():
        assert out[f"ccld_header.{name}"] == off, name


# ----------------------------------------------------------------------------- ring
RING_CHUNK = 1 << 17
RING_GROUP = 0x0DD0DD0DD0DD0001


def ring_expected(rank: int) -> list[tuple[int, ...]]:
    """Records left on comm rank `rank`'s board by op 2 (see scenario_ring). Comm rank i
    is global rank 2i+1; tuples are shape()."""
    g = [2 * i + 1 for i in range(8)]
    nxt, prev = g[(rank + 1) % 8], g[(rank + 7) % 8]
    stalled = {
        3: [(SEND, nxt, LOCAL, 3, 2), (RECV, prev, LOCAL, 3, 2)],
        2: [(SEND, nxt, PEER, 4, 3)],
        6: [(SEND, nxt, NETWORK, 8, 5)],  # steps 6, 7 queued behind the stuck step 5
        7: [(RECV, prev, NETWORK, 6, 5)],
    }.get(rank, [])
    rows = []
    for ch in (0, 1):
        if stalled:
            rows.append((ch, SEND, NO_RANK, NONE, 0, 0, 0))  # its kernel still runs
        for direction, peer, wait, posted, done in stalled:
            rows.append((ch, direction, peer, wait, posted, done, done * RING_CHUNK))
    return sorted(rows)


@pytest.mark.parametrize("version", VERSIONS)
def test_ring_all_reduce_stalls(build: Build, tmp_path: Path, version: int) -> None:
    """8-rank ring all-reduce on 2 channels: op 1 completes, op 2 stalls with one rank's GPU
    stuck (3), a sender waiting for that rank's credit (2), and a dead link (6 -> 7)."""
    boards = {}
    for rank in range(8):
        board = tmp_path / f"rank{rank}.board"
        out = run(build, "ring", board, version, rank)
        assert out["version"] == version
        assert out["comm_bound"] == 1 and out["comm_group"] == RING_GROUP
        assert out["comms"] == [[0xC0FFEE, RING_GROUP]]
        assert out["stats"]["traced"] == 2 and out["stats"]["dropped"] == 0
        recs = channels(board)
        assert sorted(shape(r) for r in recs) == ring_expected(rank), f"rank {rank}"
        for r in recs:
            assert r["source"] == SRC_NCCL
            assert (r["group_id"], r["seq"], r["pid"]) == (RING_GROUP, 2, out["pid"])
            assert 0 < r["first_ns"] <= r["last_progress_ns"]
        assert board_errors(board) == 0
        boards[2 * rank + 1] = recs
        # Per-link totals: the steps of every completed proxy op (both channels), op 1
        # everywhere and op 2 where it did not stall.
        g = [2 * i + 1 for i in range(8)]
        stalled_dirs = {
            d
            for d, *_ in {3: [(SEND,), (RECV,)], 2: [(SEND,)], 6: [(SEND,)], 7: [(RECV,)]}.get(
                rank, []
            )
        }
        want = {
            (SEND, g[(rank + 1) % 8]): 16 if SEND in stalled_dirs else 32,
            (RECV, g[(rank + 7) % 8]): 16 if RECV in stalled_dirs else 32,
        }
        tot = channels(board, totals=True)
        assert {(r["direction"], r["peer"]): r["steps_done"] for r in tot} == want
        assert all(
            r["bytes_done"] == r["steps_done"] * RING_CHUNK and r["group_id"] == RING_GROUP
            for r in tot
        )

    # What the diagnoser reads from these boards: the GPU-bound rank is the one whose own
    # connections wait locally, and the peer others wait for; the dead link is the pair
    # whose connections both wait on the network.
    local = {rank for rank, recs in boards.items() for r in recs if r["wait"] == LOCAL}
    waited_for = {r["peer"] for recs in boards.values() for r in recs if r["wait"] == PEER}
    network = {
        (rank, r["peer"]) for rank, recs in boards.items() for r in recs if r["wait"] == NETWORK
    }
    assert local == waited_for == {7}
    assert network == {(13, 15), (15, 13)}


# ----------------------------------------------------------------------------- verdicts
# One fault in an 8-rank ring (comm rank i = global rank 2i+1), spread the way NCCL's
# transfer steps spread it (nccl_harness.c, ring_fault); what each rank's board holds is
# turned into summary entries by the agent's NcclChannels and read by the diagnoser.
FAULT_NONE, FAULT_GPU, FAULT_CREDIT, FAULT_LINK = 0, 1, 2, 3
READ_LATER_S = 5.0  # the boards are read as if 5 s later: the stalled steps have not moved


def ring_fault_view(build: Build, tmp_path: Path, fault: int, where: int):
    from ccld_plugin.agent.board_summary import in_flight_ops
    from ccld_plugin.board.reader import BoardReader
    from ccld_plugin.diagnose.view import JobView
    from ccld_plugin.probes.nccl_channels import NcclChannels
    from ccld_plugin.topology import GroupInfo
    from ccld_plugin.wire.codes import STATE_IN_FLIGHT
    from ccld_plugin.wire.peer_channels import encode_channels
    from ccld_plugin.wire.summary import GroupProgress, RankSummary

    summaries, tables = {}, {}
    group = GroupInfo(RING_GROUP, "dp", tuple(2 * i + 1 for i in range(8)))
    for rank in range(8):
        board = tmp_path / f"f{fault}w{where}r{rank}.board"
        out = run(build, "ringfault", board, 6, rank, fault, where)
        assert out["stats"]["traced"] == 2 and out["stats"]["dropped"] == 0
        reader = BoardReader(board)
        now = reader.header().start_mono_ns + int(READ_LATER_S * 1e9)
        ops = reader.ops()
        flights = ops[ops["state"] == STATE_IN_FLIGHT]
        entries = NcclChannels().sample(reader.channels(), now)
        g = 2 * rank + 1
        summaries[g] = RankSummary(
            rank=g,
            pid=out["pid"],
            host="h",
            time_ns=now,
            heartbeat_ns=now,
            step=3,
            last_progress_ns=int(ops["exit_ns"].max()),
            groups_version=1,
            groups=[GroupProgress(0, int(ops["seq"].max()), 1, 0, 0, 0, 0)],
            in_flight=in_flight_ops(flights),
            channels=encode_channels(entries, 1.0, len(entries)),
        )
        tables[g] = [group]
        reader.close()
    now = max(s.time_ns for s in summaries.values())
    return JobView(summaries, tables, now, 0, 16), group


def hang_verdicts(view):
    from ccld_plugin.diagnose.analyzer import located_by_channels
    from ccld_plugin.diagnose.stalls.hang import find_hangs

    return find_hangs(view, lambda gid: 3.0, 1.0, located_by_channels)


GPU_WAITS = {("send", "local"), ("recv", "local")}
LINK_WAITS = {("send", "network"), ("recv", "local")}


@pytest.mark.parametrize(
    ("fault", "where", "ranks", "cause", "waits"),
    [
        (FAULT_GPU, 3, [7], "compute", GPU_WAITS),
        (FAULT_GPU, 0, [1], "compute", GPU_WAITS),
        (FAULT_CREDIT, 5, [11], "communication", {("send", "local")}),  # starved, posts no recv
        (FAULT_LINK, 6, [13, 15], "communication", LINK_WAITS),
        (FAULT_LINK, 7, [1, 15], "communication", None),  # the ring's wrap-around link 15 -> 1
    ],
)
def test_ring_fault_verdict(
    build: Build,
    tmp_path: Path,
    fault: int,
    where: int,
    ranks: list[int],
    cause: str,
    waits: set[tuple[str, str]] | None,
) -> None:
    """Every rank entered the all-reduce and it stalls: the wait states of the NCCL
    channels name the stuck GPU (compute), the rank that grants no credit, or the link;
    ``ccld inspect`` shows the culprit's waiting channels."""
    from rich.console import Console

    from ccld_plugin.postmortem.inspect_boards import inspect_boards, print_status

    view, group = ring_fault_view(build, tmp_path, fault, where)
    statuses = {st.rank: st for st in inspect_boards(tmp_path)}
    if waits is not None:
        shown = statuses[2 * where + 1].waiting_channels
        assert {(c.direction, c.wait) for c in shown} == waits
        assert all(c.source == "nccl" and c.seq == 2 for c in shown)
    console = Console(record=True, width=400)
    print_status(list(statuses.values()), console)
    assert "nccl ch0" in console.export_text()
    verdicts = hang_verdicts(view)
    assert len(verdicts) == 1, [v.evidence for v in verdicts]
    v = verdicts[0]
    assert (v.kind.value, v.cause.value, v.ranks) == ("hang", cause, ranks), v.evidence
    assert v.group["ranks"] == list(group.ranks) and v.op == "all_reduce"
    assert v.trace_id == f"{RING_GROUP:016x}:2"
    assert v.link == (ranks if fault == FAULT_LINK else None)
    waits = [e for e in v.evidence if e.fact == "nccl_wait"]
    assert waits and all(e.data["stalled_s"] >= 1.0 for e in waits)


def test_ring_without_fault_has_no_stalled_channels(build: Build, tmp_path: Path) -> None:
    from ccld_plugin.diagnose.links.nccl_evidence import nccl_stalls

    view, group = ring_fault_view(build, tmp_path, FAULT_NONE, 0)
    assert nccl_stalls(view, group.ranks) == {}


# ----------------------------------------------------------------------------- p2p
@pytest.mark.parametrize("version", VERSIONS)
def test_p2p_pair_maps_peers_to_global_ranks(build: Build, tmp_path: Path, version: int) -> None:
    """A send 2 -> 5 over a dedicated 2-rank comm (as torch creates for send/recv): the
    comm-local peer becomes the global rank named by the tracer's P2P op record."""
    for side, me, peer, direction in ((0, 2, 5, SEND), (1, 5, 2, RECV)):
        board = tmp_path / f"p2p{side}.board"
        out = run(build, "p2p", board, version, side)
        assert out["comm_group"] == 0x778899
        recs = channels(board)
        # Channel 0 stalls on the network at step 2; channel 1 completed and was released.
        assert sorted(shape(r) for r in recs) == sorted(
            [
                (0, direction, peer, NETWORK, 3, 2, 2 << 16),
                (0, SEND, NO_RANK, NONE, 0, 0, 0),
            ]
        ), f"global rank {me}"
        assert {(r["group_id"], r["seq"]) for r in recs} == {(0x778899, 4)}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("jump", [0, 1], ids=["steady", "timer-jumps"])
def test_kernel_channel_gpu_times_land_on_the_traced_op(
    build: Build, tmp_path: Path, version: int, jump: int
) -> None:
    """A traced op's device start and end are its channels' GPU timer stamps (the earliest
    start, the latest stop), mapped from the timer's epoch to the host's monotonic clock
    within the error written beside them, also across a jump of the timer."""
    from ccld_plugin.board.reader import BoardReader
    from ccld_plugin.wire.codes import TIME_PROFILER

    board = tmp_path / "gpuclock.board"
    out = run(build, "gpuclock", board, version, jump)
    with BoardReader(board) as r:
        recs = {int(o["index_lo"]): o for o in r.ops()}
    # the error bounds come from the host's own wakeups (the call, the proxy's look), so
    # they grow with the host's load: measured against the run itself, not in microseconds
    span = max(end for _, _, end in out["ops"]) - min(start for _, start, _ in out["ops"])
    for index, start, end in out["ops"]:
        rec = recs[index]
        assert rec["dev_source"] == TIME_PROFILER | TIME_PROFILER << 4
        err = int(rec["dev_err_ns"])
        assert abs(int(rec["dev_start_ns"]) - start) <= err
        assert abs(int(rec["dev_end_ns"]) - end) <= err
        assert 0 < err < span / len(out["ops"]), (err, span)  # finer than an op's share


# ----------------------------------------------------------------------------- edge cases
EDGE_GROUP = 0xE00E00


@pytest.mark.parametrize("version", VERSIONS)
def test_edge_cases(build: Build, tmp_path: Path, version: int) -> None:
    """PXN ops from a foreign pid, handles that are not ours, stale and missing trace ids,
    a full channel table and an exhausted event pool: tracked honestly or dropped, never
    a crash, never a non-zero return."""
    board = tmp_path / "edge.board"
    out = run(build, "edge", board, version)
    checks = [
        "foreign op tracked",
        "orphan op tracked",
        "bad context: no task",
        "bad context: op tracked",
        "step without a proxy-op parent: NULL",
        "untracked event types: NULL",
    ]
    for bit, what in enumerate(checks):
        assert out["results"] >> bit & 1, what
    assert out["tracked"] == [1, 1, 1, 1]
    assert out["v5_launch_tracked"] == (version >= 5)

    by_channel = {r["channel_id"]: r for r in channels(board)}
    pid = out["pid"]

    def rec(ch: int) -> tuple[int, ...]:
        r = by_channel[ch]
        return (r["direction"], r["peer"], r["wait"], r["group_id"], r["seq"], r["pid"])

    # comm rank i is global rank 40 + i
    assert rec(0) == (SEND, 41, PEER, EDGE_GROUP, 1, pid)  # oldest step (0) waits on peer
    assert shape(by_channel[0])[4:] == (2, 1, 0)
    assert rec(3) == (RECV, 42, NETWORK, EDGE_GROUP, 0, pid ^ 0x40000000)  # PXN: seq unknown
    assert rec(4) == (SEND, 43, NONE, EDGE_GROUP, 0, pid)  # parent not ours
    assert rec(5) == (SEND, NO_RANK, NONE, 0, 0, pid)  # context not ours: nothing known
    assert rec(6) == (SEND, 41, NONE, EDGE_GROUP, 0, pid)  # trace of another group ignored
    assert rec(7) == (SEND, 41, NONE, EDGE_GROUP, 0, pid)  # no trace on the thread
    if version >= 5:  # launched on a thread without a trace: inherited from the API event
        assert rec(8) == (RECV, 42, NONE, EDGE_GROUP, 2, pid)
    assert len(by_channel) == out["records_now"] == out["before_fill"]

    # Channel table of 24 records: the overflow is refused and counted, then all released.
    assert out["before_fill"] + out["filled"] == out["full_records"] == 24
    assert out["refused"] == 32 - out["filled"]
    assert out["after_fill"] == out["before_fill"]
    assert board_errors(board) == out["refused"]
    # Event pool: NULL handles once it is empty, every handle back after the stops.
    assert out["null_steps"] > 0
    assert out["live_events_after"] == out["live_events_before"] - 1
    s = out["stats"]
    assert s["dropped"] == out["refused"] + out["null_steps"]
    assert (s["foreign_ops"], s["trace_mismatch"], s["untraced"]) == (1, 1, 1)
    assert s["traced"] == (2 if version >= 5 else 1)
    assert out["warnings"] == 2  # each exhaustion is logged once
    # Two proxy ops on one (op, channel, peer, direction) share a record until both stop.
    assert out["shared"] == [1, 2, 1, 0]


@pytest.mark.parametrize("version", VERSIONS)
def test_finalize_takes_in_flight_records_off_the_board(
    build: Build, tmp_path: Path, version: int
) -> None:
    """An aborted comm never stops its events; its records must not read as stuck."""
    out = run(build, "abort", tmp_path / "abort.board", version)
    assert (out["in_flight"], out["after_finalize"], out["after_stops"]) == (2, 0, 0)
    assert out["stats"]["live_channels"] == 0 and out["stats"]["live_events"] == 0


def test_no_board_records_nothing(build: Build) -> None:
    out = run(build, "noboard")
    assert out["ctx"] == 1 and out["handles"] == 0
    assert out["stats"]["no_board"] > 0 and out["stats"]["live_events"] == 0


# ----------------------------------------------------------------------------- threads
@pytest.mark.parametrize("version", VERSIONS)
def test_concurrent_callers_and_proxies(build: Build, tmp_path: Path, version: int) -> None:
    """4 caller threads (one comm each) and 2 proxy threads: every op's record shows up
    under its own (group, seq) while in flight, and everything is released at the end."""
    out = run(build, "threads", tmp_path / "threads.board", version)
    assert out["processed"] == out["expected"]
    assert out["mismatches"] == 0
    assert out["bound_ok"] == 1
    assert out["records_now"] == 0
    s = out["stats"]
    assert s["traced"] == out["expected"]
    assert (s["dropped"], s["live_events"], s["live_channels"]) == (0, 0, 0)


# ----------------------------------------------------------------------------- benchmark
def test_cost_per_event_benchmark(
    build: Build, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prints the plugin's cost per event; measured, not asserted."""
    for version in VERSIONS:
        out = run(build, "bench", tmp_path / f"bench{version}.board", version)
        with capsys.disabled():
            print(
                f"\nnccl profiler v{version}: {out['step_event_ns']:.0f} ns per ProxyStep "
                f"event, {out['caller_event_ns']:.0f} ns per caller-thread event, "
                f"{out['proxy_op_event_ns']:.0f} ns per ProxyOp event"
            )
        assert out["stats"]["live_channels"] == 0


# ----------------------------------------------------------------------------- python side


def test_agent_entries_from_nccl_records() -> None:
    """NcclChannels: one entry per (peer, direction), bytes moved since the last tick,
    pending bytes from the completed steps' size, the oldest wait; idle ones left out."""
    from ccld_plugin.board.reader import CHANNEL_DTYPE
    from ccld_plugin.probes.nccl_channels import NcclChannels

    def recs(*rows: dict) -> np.ndarray:
        a = np.zeros(len(rows), CHANNEL_DTYPE)
        for i, r in enumerate(rows):
            base = dict(
                source=SRC_NCCL,
                direction=SEND,
                peer=3,
                group_id=9,
                seq=1,
                first_ns=100,
                last_progress_ns=1_000,
            )
            for k, v in {**base, **r}.items():
                a[i][k] = v
        return a

    nc = NcclChannels()
    first = recs(
        dict(channel_id=0, steps_posted=4, steps_done=2, bytes_done=2048, wait=PEER),
        dict(channel_id=1, steps_posted=2, steps_done=2, bytes_done=2048),
        dict(channel_id=0, peer=NO_RANK),  # a kernel channel: no peer, not an entry
        dict(channel_id=0, peer=5, direction=RECV, steps_posted=1, steps_done=1, bytes_done=512),
    )
    (send, recv) = sorted(nc.sample(first, 3_000_000_000), key=lambda e: e.peer)
    assert (send.peer, send.direction, send.wait, send.conns, send.sent, send.queued) == (
        3,
        "send",
        "peer",
        2,
        4096,
        2 * 1024,
    )
    assert send.source == "nccl" and send.stalled_s == pytest.approx(3.0, abs=1e-3)
    assert (recv.peer, recv.direction, recv.wait, recv.received, recv.queued) == (
        5,
        "recv",
        "none",
        512,
        0,
    )
    # Next tick: channel 0 moved one more step; the recv record is idle (left out); a new
    # connection in channel 1's slot (another first_ns) counts from zero.
    second = recs(
        dict(channel_id=0, steps_posted=4, steps_done=3, bytes_done=3072, wait=PEER),
        dict(channel_id=1, steps_posted=1, steps_done=1, bytes_done=1024, first_ns=200),
        dict(channel_id=0, peer=5, direction=RECV, steps_posted=1, steps_done=1, bytes_done=512),
    )
    (send,) = nc.sample(second, 4_000_000_000)
    assert (send.sent, send.queued, send.wait) == (1024 + 1024, 1024, "peer")
