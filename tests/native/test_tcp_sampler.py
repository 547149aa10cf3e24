"""Channel evidence: the summary codec, the diagnoser's reading of stalled and slow
connections (on synthetic views), and the agent's sampler on real loopback sockets."""

from __future__ import annotations

import socket
import time

from ccld_plugin import _native
from ccld_plugin.board.reader import BoardReader
from ccld_plugin.control.deadline import StoreTimeout
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.probes.tcp_channels import ChannelSampler
from ccld_plugin.topology import GroupInfo, group_id_of
from ccld_plugin.wire.peer_channels import (
    PeerChannel,
    decode_channels,
    encode_channels,
)
from ccld_plugin.wire.summary import RankSummary

S = 1_000_000_000
INTERVAL = 0.5


def group(role: str, ranks: list[int]) -> GroupInfo:
    return GroupInfo(group_id_of(ranks), role, tuple(ranks))


DP4 = [group("world", [0, 1, 2, 3]), group("dp", [0, 1, 2, 3])]


def view(
    reports: dict[int, list[PeerChannel]],
    now: int = 100 * S,
    ages: dict[int, float] | None = None,
    groups: list[GroupInfo] = DP4,
) -> JobView:
    """A view in which rank r's latest summary, made ages[r] seconds ago, carries
    reports[r] as its channel evidence."""
    ages = ages or {}
    summaries = {}
    for r, entries in reports.items():
        t = now - int(ages.get(r, 0.0) * S)
        summaries[r] = RankSummary(
            rank=r,
            pid=1000 + r,
            host="h",
            time_ns=t,
            heartbeat_ns=t,
            step=5,
            last_progress_ns=t,
            groups_version=1,
            channels=encode_channels(entries, INTERVAL, len(entries)),
        )
    return JobView(
        summaries=summaries,
        tables={r: groups for r in reports},
        now_ns=now,
        job_start_ns=0,
        world=4,
    )


# --- codec ----------------------------------------------------------------------------------


# --- hangs ----------------------------------------------------------------------------------


# --- slowness --------------------------------------------------------------------------------


# --- the agent's sampler on real sockets -----------------------------------------------------


class FakeControl:
    """The two control-plane calls the sampler makes, over a dict."""

    def __init__(self) -> None:
        self.endpoints: dict[int, list[tuple[str, int]]] = {}
        self.reads = 0

    def publish_endpoints(self, rank: int, endpoints: list[tuple[str, int]]) -> None:
        self.endpoints[rank] = list(endpoints)

    def read_endpoints(self, ranks: list[int]) -> dict[int, list[tuple[str, int]]]:
        self.reads += 1
        return {r: self.endpoints[r] for r in ranks if r in self.endpoints}


def test_sampler_maps_classifies_and_fills_the_board(tmp_path, sockets) -> None:
    # "Rank 0" (this sampler) connects to two listeners of "rank 1": one receiver reads
    # what it gets, the other never reads.
    board = _native.Board(str(tmp_path / "rank0.board"), 0, 2, "j", "h", 16, 4, 16, 16)
    control = FakeControl()
    pairs = []
    for rcvbuf in (0, 8192):
        ls = socket.create_server(("127.0.0.1", 0))
        if rcvbuf:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        c = socket.create_connection(("127.0.0.1", ls.getsockname()[1]), timeout=5)
        srv, _ = ls.accept()
        sockets += [ls, c, srv]
        pairs.append((c, srv))
    # What rank 1 would publish: the local ends of its accepted connections.
    control.endpoints[1] = [srv.getsockname()[:2] for _, srv in pairs]
    sampler = ChannelSampler(board, control, rank=0, world=2)
    (flow_c, flow_s), (stuck_c, _) = pairs
    stuck_c.setblocking(False)
    blob = b"x" * 65536
    data = b""
    for _ in range(6):
        flow_c.sendall(blob)
        got = 0
        while got < len(blob):
            got += len(flow_s.recv(1 << 20))
        for _ in range(64):  # fill the non-reader's window and our send buffer
            try:
                stuck_c.send(blob)
            except BlockingIOError:
                break
        data = sampler.tick()
        time.sleep(0.2)
    rep = decode_channels(0, 0, data)
    assert rep is not None and control.endpoints[0]  # published its own endpoints
    mine = [e for e in rep.entries if e.peer == 1]
    assert len(mine) == 1 and mine[0].conns == 2
    e = mine[0]
    assert e.wait == "peer" and e.direction == "send" and e.queued > 0
    assert e.rwnd_share > 0.5 and e.stalled_s >= 0.5
    # One board record per connection of rank 0 to rank 1, the stuck one waiting on it.
    with BoardReader(tmp_path / "rank0.board") as r:
        recs = r.channels()
    to_1 = recs[recs["peer"] == 1]
    assert len(to_1) == 2 and set(to_1["wait"]) == {0, 2}  # none (flowing), peer
    assert (to_1["bytes_done"] > 0).all() and (to_1["last_progress_ns"] > 0).all()
    assert sampler.cost_us()["median_us"] > 0
    # Closed connections give their board slots back.
    for s in sockets:
        s.close()
    sampler.tick()
    with BoardReader(tmp_path / "rank0.board") as r:
        assert len(r.channels()) == 0
    board.close(unlink=True)


class CutOffControl(FakeControl):
    """A control plane whose store stops answering (the link to its host is cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = False

    def publish_endpoints(self, rank: int, endpoints: list[tuple[str, int]]) -> None:
        if self.cut:
            raise StoreTimeout("the store did not answer a set within 2 s")
        super().publish_endpoints(rank, endpoints)

    def read_endpoints(self, ranks: list[int]) -> dict[int, list[tuple[str, int]]]:
        if self.cut:
            raise StoreTimeout("the store did not answer a multi_get within 2 s")
        return super().read_endpoints(ranks)


def test_sampler_reports_mapped_peers_while_the_store_does_not_answer(tmp_path, sockets) -> None:
    # A cut link often cuts this rank off the store too: its own channel evidence (bytes
    # queued to a peer) is then what names it, and must not be lost to the store's failure
    # when a connection opens and its endpoints cannot be published or mapped.
    board = _native.Board(str(tmp_path / "rank0.board"), 0, 2, "j", "h", 16, 4, 16, 16)
    control = CutOffControl()
    ls = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(("127.0.0.1", ls.getsockname()[1]), timeout=5)
    srv, _ = ls.accept()
    sockets += [ls, c, srv]
    control.endpoints[1] = [srv.getsockname()[:2]]
    sampler = ChannelSampler(board, control, rank=0, world=2)
    sampler.tick()
    control.cut = True
    ls2 = socket.create_server(("127.0.0.1", 0))  # a new connection, to no known rank
    c2 = socket.create_connection(("127.0.0.1", ls2.getsockname()[1]), timeout=5)
    sockets += [ls2, c2]
    blob = b"x" * 65536
    for _ in range(3):
        c.sendall(blob)
        got = 0
        while got < len(blob):
            got += len(srv.recv(1 << 20))
        data = sampler.tick()
        time.sleep(0.1)
    rep = decode_channels(0, 0, data)
    assert rep is not None
    assert [e.peer for e in rep.entries] == [1] and rep.entries[0].sent > 0
    board.close(unlink=True)
