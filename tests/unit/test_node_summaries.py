"""Node summaries: the frame of a node's per-rank summaries, the summary files a node's
ranks hand to their leader, who leads, and the control plane that reads one key per node
and gives back per-rank summaries (over a real TCPStore in this process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from builders import rank_summary

from ccld_harness.launch import free_port
from ccld_plugin.agent.board_summary import as_board_stands
from ccld_plugin.agent.node_board import (
    EXITED,
    STORE_LOST,
    LocalSummary,
    choose_leader,
    read_local,
    remove_local,
    summary_path,
    write_local,
)
from ccld_plugin.agent.node_share import NodeShare
from ccld_plugin.board.process import PF_EXITING, process_alive, running
from ccld_plugin.config import CcldConfig, ControlConfig
from ccld_plugin.control import ControlPlane
from ccld_plugin.services.diagnoser import Diagnoser
from ccld_plugin.wire.codes import OP_NAMES, STATE_IN_FLIGHT
from ccld_plugin.wire.node_summary import (
    decode_node,
    decode_nodes,
    encode_node,
    node_count,
    node_of,
    node_ranks,
)
from ccld_plugin.wire.summary import FLAG_LAST_WORDS, decode_summary, encode_summary

JOB_START = 123_456_789


def _summaries(ranks: range) -> dict[int, bytes]:
    return {r: encode_summary(rank_summary(r, step=r + 1)) for r in ranks}


def test_nodes_are_runs_of_consecutive_ranks() -> None:
    assert [node_of(r, 4) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert node_ranks(1, 4, 10) == range(4, 8)
    assert node_ranks(2, 4, 10) == range(8, 10)  # the last node holds what is left
    assert node_count(10, 4) == 3 and node_count(8, 4) == 2 and node_count(5, 1) == 5


def test_a_frame_gives_back_each_ranks_summary_byte_for_byte() -> None:
    ranks = node_ranks(1, 4, 16)
    per_rank = _summaries(ranks)
    frame = encode_node(sorted(per_rank.items()))
    got = decode_node(frame, ranks)
    assert got == per_rank
    assert [decode_summary(got[r]).step for r in ranks] == [5, 6, 7, 8]
    # Cost: 10 bytes of header, 8 per rank, beside the summaries themselves.
    assert len(frame) == 6 + 8 * 4 + sum(map(len, per_rank.values()))
    assert decode_node(encode_node([]), ranks) == {}


def test_a_frame_of_one_rank_is_a_rank_alone_on_its_node() -> None:
    data = _summaries(range(3, 4))
    assert decode_node(encode_node(data.items()), node_ranks(3, 1, 8)) == data


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (b"CC", "shorter than its header"),
        (b"XXXX\x00\x00", "not a node frame"),
        (encode_node([(4, b"abc")])[:-1], "truncated"),
        (encode_node([(4, b"abc")]) + b"!", "after its last summary"),
        (encode_node([(4, b"a"), (4, b"b")]), "twice"),
        (encode_node([(9, b"a")]), "not of ranks 4.."),
        (encode_node([(4, b"a")])[:8], "truncated"),
    ],
)
def test_a_bad_frame_is_refused_whole(frame: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_node(frame, range(4, 8))
    # Among good frames, read all at once: only its node is left out, for the same reason.
    good = {n: _summaries(node_ranks(n, 4, 16)) for n in (0, 2, 3)}
    frames = [(n, encode_node(good[n].items())) for n in (0, 2, 3)]
    packed, bad = decode_nodes([*frames[:1], (1, frame), *frames[1:]], 4, 16)
    assert packed == {**good[0], **good[2], **good[3]}
    assert list(bad) == [1] and why in bad[1]


def test_many_frames_read_at_once_give_what_each_gives() -> None:
    world = 10  # a last node of two ranks
    per_node = {n: _summaries(node_ranks(n, 4, world)) for n in range(node_count(world, 4))}
    frames = [(n, encode_node(reversed(per_node[n].items()))) for n in (2, 0, 1)]
    packed, bad = decode_nodes(frames, 4, world)
    assert bad == {}
    assert list(packed) == list(range(world))  # in rank order, whatever the frames'
    assert packed == {r: v for n in per_node for r, v in per_node[n].items()}
    assert decode_nodes([], 4, world) == ({}, {})
    # one rank's newer value, beside or in place of the frames'
    newer = encode_summary(rank_summary(3, step=50))
    assert packed.merged({3: newer}) == {**packed, 3: newer}
    assert packed.select(packed.ranks >= 8) == {8: packed[8], 9: packed[9]}


def test_summary_file_round_trip_and_removal(tmp_path: Path) -> None:
    path = summary_path(tmp_path / "rank3.board")
    assert path.name == "rank3.summary" and read_local(path) is None
    s = LocalSummary(EXITED, 4242, 17, JOB_START, 4026531840, b"summary bytes")
    write_local(path, s)
    assert read_local(path) == s
    assert path.stat().st_mode & 0o777 == 0o600
    path.write_bytes(b"not ours at all")
    assert read_local(path) is None
    remove_local(path)
    assert not path.exists()


NET = 4026531992  # a network namespace's inode


def _file(
    tick: int, flags: int = 0, pid: int = 100, job_start: int = JOB_START, net: int = NET
) -> LocalSummary:
    return LocalSummary(flags, pid, tick, job_start, net, b"")


def _leader(me: int, files: dict[int, LocalSummary | None], tick: int = 10, dead=()) -> int | None:
    lower = sorted(r for r in range(4, me))  # node 1 of 4-rank nodes
    return choose_leader(me, lower, files.get, tick, JOB_START, NET, lambda pid: pid not in dead)


def test_the_first_rank_that_can_leads() -> None:
    assert _leader(4, {}) == 4  # the node's first rank
    assert _leader(5, {4: _file(10)}) == 4
    assert _leader(6, {4: _file(10), 5: _file(10)}) == 4
    assert _leader(5, {4: _file(9)}) == 4  # one tick late: a loaded host, still leading


@pytest.mark.parametrize(
    "leader",
    [
        _file(8),  # two ticks behind: frozen, or its agent wedged
        _file(10, flags=EXITED),  # left through the exit path
        _file(10, flags=STORE_LOST),  # cannot publish
        _file(10, pid=7),  # its process is gone
    ],
)
def test_a_leader_that_cannot_lead_is_passed_over(leader: LocalSummary) -> None:
    files = {4: leader, 5: _file(10)}
    assert _leader(5, files, dead=(7,)) == 5  # it takes over
    assert _leader(6, files, dead=(7,)) == 5  # the next rank, as every rank sees it
    assert _leader(6, {**files, 5: _file(10, pid=7)}, dead=(7,)) == 6


@pytest.mark.parametrize(
    "unseen",
    [
        None,  # no file: not started, left, or another /dev/shm (a container per rank)
        _file(10, job_start=1),  # a file of an earlier run of the job name
        _file(10, net=NET + 1),  # another network namespace: another host to the network
    ],
)
def test_a_node_that_is_not_as_configured_falls_back_to_own_keys(unseen) -> None:
    files = {4: unseen, 5: _file(10)}
    assert _leader(4, files) == 4  # nothing below it to see
    assert _leader(5, files) is None  # it publishes its own key, and leads nothing
    assert _leader(6, files) is None
    assert _leader(6, {4: _file(10, pid=7), 5: unseen}, dead=(7,)) is None


def test_a_process_that_cannot_be_looked_at_counts_as_alive() -> None:
    files = {0: _file(10)}
    assert choose_leader(1, [0], files.get, 10, JOB_START, NET, lambda pid: None) == 0


def test_an_unknown_network_namespace_matches_any() -> None:
    assert _file(10, net=0).of_node(JOB_START, NET) and _file(10).of_node(JOB_START, 0)


@pytest.fixture
def planes(monkeypatch: pytest.MonkeyPatch):
    """A job's control plane (ranks 0 and 5 of 8, 4 ranks per node) over a real TCPStore,
    and a reader outside the job that knows nothing of its nodes."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    cfg = ControlConfig(store="dedicated", port=free_port(), connect_timeout_s=10, chunk_keys=1)
    host = ControlPlane(cfg, 0, 8, "nodes-test", 0, ranks_per_node=4)
    other = ControlPlane(cfg, 5, 8, "nodes-test", 0, ranks_per_node=4)
    outside = ControlPlane.client(cfg, "127.0.0.1", cfg.port, "nodes-test", 8)
    return host, other, outside


def test_the_plane_reads_node_keys_as_per_rank_summaries(planes) -> None:
    host, other, outside = planes
    assert host.read_summaries(range(8)) == {}
    nodes = [_summaries(node_ranks(n, 4, 8)) for n in range(2)]
    host.publish_node(0, encode_node(nodes[0].items()))
    other.publish_node(1, encode_node(nodes[1].items()))
    both = {**nodes[0], **nodes[1]}
    assert host.read_summaries(range(8)) == both
    assert outside.read_summaries(range(8)) == both  # it read the node size from the store
    assert host.read_summaries([1, 6]) == {1: both[1], 6: both[6]}
    assert not host.store.check(["s/1"])  # a node key, no per-rank keys


def test_a_ranks_own_key_shadows_its_frame_until_withdrawn(planes) -> None:
    host, other, _ = planes
    node = _summaries(node_ranks(1, 4, 8))
    other.publish_node(1, encode_node(node.items()))
    last = encode_summary(rank_summary(5, step=99))
    other.publish(5, last)  # e.g. its last summary, at exit
    other.publish(5, last)  # listed once
    assert host.read_summaries(range(8)) == {**node, 5: last}
    assert bytes(host.store.get("s/listed")) == b"5\n"
    other.withdraw(5)
    assert host.read_summaries(range(8)) == node
    assert bytes(host.store.get("s/5")) == b""  # emptied, not deleted


def test_a_corrupt_frame_leaves_its_node_out_and_is_counted(planes) -> None:
    from ccld_plugin import errors

    host, other, _ = planes
    node0 = _summaries(node_ranks(0, 4, 8))
    host.publish_node(0, encode_node(node0.items()))
    other.publish_node(1, encode_node([(0, b"rank 0 is not of node 1")]))
    before = errors.contained_errors().get("control.node_summary", 0)
    assert host.read_summaries(range(8)) == node0
    assert errors.contained_errors()["control.node_summary"] == before + 1


def test_ranks_alone_on_their_nodes_write_their_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    cfg = ControlConfig(store="dedicated", port=free_port(), connect_timeout_s=10)
    host = ControlPlane(cfg, 0, 3, "alone-test", 0, ranks_per_node=1)
    outside = ControlPlane.client(cfg, "127.0.0.1", cfg.port, "alone-test", 3)
    per_rank = _summaries(range(3))
    for r, data in per_rank.items():
        host.publish(r, data)
    assert host.read_summaries(range(3)) == per_rank
    assert outside.read_summaries(range(3)) == per_rank  # no node size: the listed keys
    assert not host.store.check(["n/0"])


_DIES_AT_STEP_6 = """
import os, signal, sys
from ccld_plugin import _native
from ccld_plugin.wire.codes import OP_CODES, STATE_DONE
b = _native.Board(sys.argv[1], 1, 2, "j", "h", 16, 4, 4, 16)
slot = b.register_group(7, 3, [0, 1], 1)
b.set_clock_offset(1000)
b.set_step(6)
b.enter(slot, OP_CODES["all_reduce"], 0, 4096)
print(os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_dead_ranks_summary_is_brought_up_to_its_board(tmp_path: Path) -> None:
    # Rank 1 of a two-rank node wrote its summary file at tick 3, at step 0; its process
    # then ran to step 6, entered an all-reduce and was killed. The leader's frame carries
    # the state its board kept: the step and the op it died in, its heartbeat the last one.
    board = tmp_path / "rank1.board"
    child = subprocess.run(
        [sys.executable, "-c", _DIES_AT_STEP_6, str(board)], capture_output=True, text=True
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    pid = int(child.stdout)
    last = rank_summary(1, time_ns=50, pid=pid, step=0, heartbeat_ns=40, last_progress_ns=40)
    write_local(summary_path(board), LocalSummary(0, pid, 3, JOB_START, 0, encode_summary(last)))
    share = NodeShare(tmp_path / "rank0.board", 0, 2, 2, os.getpid(), 0.01, threading.Event())
    mine = encode_summary(rank_summary(0))
    s = decode_summary(decode_node(share.frame(mine, 5, JOB_START), range(2))[1])
    assert (s.step, s.heartbeat_ns, s.pid) == (6, 40, pid)
    (op,) = s.in_flight
    assert (OP_NAMES[op.op], op.bytes, op.state) == ("all_reduce", 4096, STATE_IN_FLIGHT)
    assert s.time_ns >= op.enter_ns  # on the diagnoser's clock, as the live summary was
    # The file of another dead process (the board now a restarted rank's) is left as it is.
    gone = subprocess.Popen(["true"])
    gone.wait()
    other = LocalSummary(0, gone.pid, 3, JOB_START, 0, encode_summary(last))
    write_local(summary_path(board), other)
    s = decode_summary(decode_node(share.frame(mine, 5, JOB_START), range(2))[1])
    assert s.step == 0


def test_a_rank_whose_board_is_closed_left_through_its_exit_path(tmp_path: Path) -> None:
    # The rank closed its board on its way out (board.cleanup off), then its process ended
    # before its final summary reached the store (one hosted by rank 0 ends with it). Its
    # board tells a clean exit, not a death: a diagnoser that reads it must not call the
    # rank unresponsive.
    board = tmp_path / "rank1.board"
    script = _DIES_AT_STEP_6.replace(
        "os.kill(os.getpid(), signal.SIGKILL)", "b.exit(0, STATE_DONE)\nb.close()\nos._exit(0)"
    )
    child = subprocess.run([sys.executable, "-c", script, str(board)], capture_output=True)
    assert child.returncode == 0, child.stderr
    pid = int(child.stdout)
    last = rank_summary(1, time_ns=50, pid=pid, step=0, heartbeat_ns=40, last_progress_ns=40)
    s = as_board_stands(board, pid, last, died=True)
    assert s is not None and s.exited and not s.flags & FLAG_LAST_WORDS
    assert s.step == 6


def test_a_stopped_ranks_summary_is_told_as_its_board_stands(tmp_path: Path) -> None:
    # As above, but the process stops itself (SIGSTOP: alive, its agent silent). While its
    # file is current it stands; once it is two ticks stale the leader tells the step and
    # op its board shows, at every tick, not flagged as last words (it may go on).
    board = tmp_path / "rank1.board"
    script = _DIES_AT_STEP_6.replace("signal.SIGKILL", "signal.SIGSTOP")
    child = subprocess.Popen([sys.executable, "-c", script, str(board)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        pid = int(child.stdout.readline())
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)
        last = rank_summary(1, time_ns=50, pid=pid, step=0, heartbeat_ns=40, last_progress_ns=40)
        write_local(
            summary_path(board), LocalSummary(0, pid, 3, JOB_START, 0, encode_summary(last))
        )
        share = NodeShare(tmp_path / "rank0.board", 0, 2, 2, os.getpid(), 0.01, threading.Event())
        mine = encode_summary(rank_summary(0))

        def told(tick: int):
            return decode_summary(decode_node(share.frame(mine, tick, JOB_START), range(2))[1])

        assert told(4).step == 0  # one tick late: a loaded host, its file stands
        s = told(5)
        assert (s.step, s.heartbeat_ns, s.pid) == (6, 40, pid)
        assert not s.flags & FLAG_LAST_WORDS
        (op,) = s.in_flight
        assert OP_NAMES[op.op] == "all_reduce"
    finally:
        child.kill()
        child.wait()


def test_a_process_in_exit_is_not_alive() -> None:
    # A killed process closes its sockets before it is a zombie: its peers fail and leave
    # while its state still reads running. Its task flags say it is exiting.
    stat = Path("/proc/self/stat").read_text()
    assert running(stat)
    head, rest = stat.rsplit(")", 1)
    fields = rest.split()
    fields[6] = str(int(fields[6]) | PF_EXITING)
    assert not running(f"{head}) {' '.join(fields)}")
    fields[6], fields[0] = str(int(fields[6]) & ~PF_EXITING), "Z"
    assert not running(f"{head}) {' '.join(fields)}")
    assert not process_alive(2**22 + 7, host="")  # no such process


_LEAVES_ON_INPUT = """
import os, sys
from ccld_plugin import _native
b = _native.Board(sys.argv[1], int(sys.argv[2]), 4, "j", "h", 16, 4, 4, 16)
print(os.getpid(), flush=True)
sys.stdin.readline()
b.close()
if sys.argv[3] == "exit path":
    os.unlink(sys.argv[1])  # board.cleanup: the exit path removes the board
os._exit(0)
"""


def test_a_rank_whose_board_went_with_it_left_through_its_exit_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A diagnoser process beside a job whose store is rank 0's: the store ends with rank 0,
    # and a rank's final summary may never be read. With board.cleanup on, the rank's exit
    # path removes its board: a board seen while the rank ran and gone with it tells a
    # clean exit, not a death. A rank killed outright leaves its board (read as its last
    # words), and a board this diagnoser never saw (another board dir) tells nothing.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    cfg = ControlConfig(store="dedicated", port=free_port(), connect_timeout_s=10)
    plane = ControlPlane(cfg, 0, 4, "exit-test", 0)
    svc = Diagnoser(CcldConfig(), plane, 4, 0, [], boards=tmp_path)
    here = os.uname().nodename
    children = {}
    for rank, how in ((1, "exit path"), (2, "killed"), (3, "exit path")):
        board = tmp_path / f"rank{rank}.board"
        args = [sys.executable, "-c", _LEAVES_ON_INPUT, str(board), str(rank), how]
        children[rank] = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    pids = {r: int(c.stdout.readline()) for r, c in children.items()}  # type: ignore[union-attr]
    raw = {r: encode_summary(rank_summary(r, pid=pids[r], host=here)) for r in pids}
    # ranks 1 and 2 seen running with their boards; rank 3's board is moved out of sight
    (tmp_path / "rank3.board").rename(tmp_path / "elsewhere")
    assert svc._gone(svc._summaries(raw)) == set()
    (tmp_path / "elsewhere").rename(tmp_path / "rank3.board")
    children[2].kill()
    for rank in (1, 3):
        children[rank].communicate(b"\n")
    children[2].wait()
    table = svc._summaries(raw)
    gone = svc._gone(table)
    assert gone == {1, 2, 3}
    words = {r: decode_summary(w) for r, w in svc._last_words(table, gone).items()}
    assert words[1].exited and not words[1].flags & FLAG_LAST_WORDS
    assert words[2].flags & FLAG_LAST_WORDS and not words[2].exited
    assert 3 not in words  # no board, never seen: its last summary stands
