"""Control plane: torch's TCPStore, under a ``ccld/<job>/`` prefix.

The job's own store when there is one (torchrun's agent store even survives a hung
worker), else a dedicated TCPStore hosted by the diagnoser rank. Keys:

- ``n/<node>``: the latest summaries of a node's ranks in one frame (``wire.node_summary``),
  written every tick by the node's leader; ``node/size``: ranks per node;
- ``s/<rank>``: a rank's own summary where no node frame carries it (its last one at exit,
  or every tick while it cannot hand it to a leader), newer than any frame; empty once
  frames carry it again; ``s/listed``: the ranks that ever wrote one, so that the
  diagnoser reads only those;
- ``g/<rank>``: the rank's group table, rewritten when it changes;
- ``clk/...``: the clock handshake; ``job_start``: the diagnoser's start time;
- ``ep/<rank>``: the (ip, port) local ends of the rank's TCP connections, which peers join
  with their remote ends to map connections to ranks (rewritten when they change);
- ``reach/<rank>``: the (ip, port) of the rank's reach port (``control.reach``), which the
  diagnoser connects to when the rank falls silent, to tell a cut link from a wedged
  process;
- ``diag/owner``, ``diag/beat``, ``diag/released``, ``diag/reported``: the diagnosis
  lease (which rank's diagnoser is in charge, its renewal counter, whether it ended on
  purpose) and the keys of the verdicts reported so far, which a standby that takes over
  does not report again;
- ``who/<rank>``: where the rank runs (its local rank and device), which verdicts name;
- ``abort``, ``abort/left``: set when the diagnoser ends the job (``actions.on_hang=abort``):
  every rank's abort watch reads it, counts itself out, and leaves once all have.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ccld_plugin.config import ControlConfig
from ccld_plugin.control.clock import CLOCK_ROUNDS, CLOCK_SPACING_S, ClockSync
from ccld_plugin.control.deadline import DeadlineStore
from ccld_plugin.control.reach import is_local_address
from ccld_plugin.errors import report_error
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.node_summary import decode_nodes, node_count
from ccld_plugin.wire.packed import PackedSummaries

__all__ = ["ControlPlane", "owner_record"]

LEAVE_POLL_S = 0.02  # how often a rank of an aborted job looks whether all have counted out


class ControlPlane:
    def __init__(
        self,
        cfg: ControlConfig,
        rank: int,
        world: int,
        job: str,
        diagnoser_rank: int,
        ranks_per_node: int = 0,
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world = world
        self.diagnoser_rank = diagnoser_rank
        self.store_prefix = f"{cfg.prefix}{job}/"
        self._start_summaries(ranks_per_node)
        # A connection of our own: a blocking call of the training loop on the job's
        # client (gloo's rendezvous) must never hold up a heartbeat, nor ours the job.
        base = _own_client(cfg) if cfg.store == "auto" else None
        if base is None:
            base = self._dedicated_store()
        self._attach(base)

    @classmethod
    def client(cls, cfg: ControlConfig, host: str, port: int, job: str, world: int) -> ControlPlane:
        """The control plane of a process outside the job (``ccld diagnoser``), over the
        job's store at ``host:port``; it is rank -1."""
        plane = object.__new__(cls)
        plane.cfg, plane.rank, plane.world, plane.diagnoser_rank = cfg, -1, world, -1
        plane.store_prefix = f"{cfg.prefix}{job}/"
        plane._start_summaries(0)  # the job's leaders say how many ranks a node holds
        timeout = timedelta(seconds=cfg.connect_timeout_s)
        plane._attach(dist.TCPStore(host, port, world, False, timeout, wait_for_workers=False))
        return plane

    def _attach(self, base: Any) -> None:
        self.address = (base.host, base.port)
        self.store = DeadlineStore(dist.PrefixStore(self.store_prefix, base))
        # A store on this host answers this rank even when its link is down: a diagnoser
        # here then hears nothing from anyone, the sign of its own isolation.
        self.store_local = is_local_address(base.host)
        # Keys seen in this store. Summary, node and endpoint keys are set and emptied,
        # never deleted, so one seen is not checked again (at 65,536 ranks the check of
        # every node key cost about as much as reading them).
        self._present: set[str] = set()

    def connect(self, timeout_s: float | None = None) -> ControlPlane:
        """Another control plane over a new connection (one per thread that blocks),
        whose connecting and requests give up after ``timeout_s`` (default: connecting
        after ``control.connect_timeout_s``, requests as set by :meth:`set_timeout`)."""
        timeout = timedelta(seconds=self.cfg.connect_timeout_s if timeout_s is None else timeout_s)
        other = object.__new__(ControlPlane)
        other.__dict__.update(self.__dict__)
        host, port = self.address
        other._attach(dist.TCPStore(host, port, self.world, False, timeout, wait_for_workers=False))
        if timeout_s is not None:
            other.set_timeout(timeout_s)
        return other

    def set_timeout(self, timeout_s: float) -> None:
        """From now on a request waits at most ``timeout_s`` for the store, then fails
        (``StoreTimeout``): start-up waits for the other ranks on purpose; after it, a
        longer wait is for a store whose host or link is down."""
        self.store.set_deadline(timeout_s)

    def _dedicated_address(self) -> tuple[str, int]:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        return host, self.cfg.port or int(os.environ.get("MASTER_PORT", "29500")) + 1

    def _dedicated_store(self) -> Any:
        host, port = self._dedicated_address()
        hosting = self.rank == max(self.diagnoser_rank, 0)  # rank 0 for ccld diagnoser
        return dist.TCPStore(
            host,
            port,
            self.world,
            hosting,
            timedelta(seconds=self.cfg.connect_timeout_s),
            wait_for_workers=False,
            # TCPStore's own listener takes every interface; the ranks need MASTER_ADDR's.
            master_listen_fd=_listen_on(host, port).detach() if hosting else None,
        )

    # ---------------------------------------------------------------- summaries
    def _start_summaries(self, ranks_per_node: int) -> None:
        self.ranks_per_node = ranks_per_node  # 0: not known yet (read from node/size)
        self._listed: set[int] = set()  # ranks whose s/<rank> this plane listed
        self._node_size_set = False

    def publish(self, rank: int, summary: bytes) -> None:
        """A rank's own summary key, for when no node frame carries it (or at exit)."""
        self.store.set(f"s/{rank}", summary)  # bytes are stored as is
        if rank not in self._listed:
            self.store.append("s/listed", f"{rank}\n")
            self._listed.add(rank)

    def withdraw(self, rank: int) -> None:
        """Empty a rank's own key: node frames carry its summary again, and the key would
        shadow them. Emptied, not deleted: a reader's multi_get of a key deleted after it
        looked would wait for the key until the request times out."""
        self.store.set(f"s/{rank}", b"")

    def publish_node(self, node: int, frame: bytes) -> None:
        if not self._node_size_set:
            self.store.set("node/size", str(self.ranks_per_node))
            self._node_size_set = True
        self.store.set(f"n/{node}", frame)

    def ping(self) -> None:
        """One request, to tell whether the store answers."""
        self.store.check(["node/size"])

    def read_summaries(self, ranks: Iterable[int]) -> PackedSummaries:
        """Latest summaries of ``ranks``: from their nodes' frames, and from their own keys
        where they wrote one (newer than a frame); ranks found in neither are left out. A
        frame that does not decode is counted (``control.node_summary``) and left out.
        Packed: the frames' bytes are read in place (``wire.packed``)."""
        ranks = list(ranks)
        wanted = set(ranks)
        everyone = wanted.issuperset(range(self.world))  # as the diagnoser asks
        packed = PackedSummaries.of({})
        size = self._node_size()
        if size > 1:  # a rank alone on its node writes its own key
            nodes = (
                list(range(node_count(self.world, size)))
                if everyone
                else sorted({r // size for r in wanted if 0 <= r < self.world})
            )
            frames = self._read_keys([f"n/{n}" for n in nodes])
            packed, bad = decode_nodes(
                [(n, f) for n, f in zip(nodes, frames, strict=True) if f is not None],
                size,
                self.world,
            )
            for n, why in bad.items():
                report_error("control.node_summary", ValueError(f"node {n}: {why}"))
            if not everyone:
                packed = packed.select(np.isin(packed.ranks, ranks))
        own = sorted(self._listed_ranks() & wanted)
        return packed.merged({r: v for r, v in self._read_per_rank("s", own).items() if v})

    def _node_size(self) -> int:
        if self.ranks_per_node <= 0 and self.store.check(["node/size"]):
            text = bytes(self.store.get("node/size"))
            size = int(text) if text.isdigit() else 0
            if 0 < size <= self.world:
                self.ranks_per_node = size
        return self.ranks_per_node

    def _listed_ranks(self) -> set[int]:
        if not self.store.check(["s/listed"]):
            return set()
        text = bytes(self.store.get("s/listed")).decode(errors="replace")
        return {int(r) for r in text.split() if r.isdigit()}

    def _read_per_rank(self, prefix: str, ranks: Iterable[int]) -> dict[int, bytes]:
        """The values of ``<prefix>/<rank>`` that exist."""
        ranks = list(ranks)
        values = self._read_keys([f"{prefix}/{r}" for r in ranks])
        return {r: v for r, v in zip(ranks, values, strict=True) if v is not None}

    def _read_keys(self, keys: list[str]) -> list[bytes | None]:
        """The values of ``keys`` (None where a key does not exist), read in chunks (one
        multi_get of many keys is slower than several of a few hundred)."""
        if not keys:
            return []
        out: list[bytes | None] = [None] * len(keys)
        present = [i for i, ok in enumerate(self._exist(keys)) if ok]
        step = self.cfg.chunk_keys
        for i in range(0, len(present), step):
            chunk = present[i : i + step]
            for k, value in zip(chunk, self.store.multi_get([keys[k] for k in chunk]), strict=True):
                out[k] = bytes(value)
        return out

    def _exist(self, keys: list[str]) -> list[bool]:
        # check() answers for all keys at once; ask key by key only when some are missing.
        unseen = [k for k in keys if k not in self._present]
        if unseen and self.store.check(unseen):
            self._present.update(unseen)
        elif unseen:
            self._present.update(k for k in unseen if self.store.check([k]))
        return [k in self._present for k in keys]

    # ---------------------------------------------------------------- groups
    def publish_groups(self, rank: int, groups: list[GroupInfo], version: int) -> None:
        self.store.set(
            f"g/{rank}",
            json.dumps(
                {
                    "version": version,
                    "groups": [[f"{g.group_id:016x}", g.role, list(g.ranks)] for g in groups],
                }
            ),
        )

    def read_groups(self, rank: int) -> tuple[int, list[GroupInfo]]:
        data = json.loads(bytes(self.store.get(f"g/{rank}")))
        return data["version"], [
            GroupInfo(int(gid, 16), role, tuple(ranks)) for gid, role, ranks in data["groups"]
        ]

    # ---------------------------------------------------------------- endpoints
    def publish_endpoints(self, rank: int, endpoints: Iterable[tuple[str, int]]) -> None:
        self.store.set(f"ep/{rank}", json.dumps([[h, p] for h, p in endpoints]))

    def read_endpoints(self, ranks: Iterable[int]) -> dict[int, list[tuple[str, int]]]:
        """Published endpoints of ``ranks``; ranks that published none are left out."""
        return {
            r: [(str(h), int(p)) for h, p in json.loads(value)]
            for r, value in self._read_per_rank("ep", ranks).items()
        }

    def publish_reach(self, rank: int, address: tuple[str, int]) -> None:
        self.store.set(f"reach/{rank}", json.dumps(list(address)))

    def read_reach(self, ranks: Iterable[int]) -> dict[int, tuple[str, int]]:
        """Published reach ports of ``ranks``; ranks that published none are left out."""
        out = {}
        for r, value in self._read_per_rank("reach", ranks).items():
            host, port = json.loads(value)
            out[r] = (str(host), int(port))
        return out

    # ---------------------------------------------------------------- clock
    def serve_clock(self, job_start_ns: int, timeout_s: float) -> None:
        """Diagnoser side: wait for the ranks to be ready, then post CLOCK_ROUNDS
        timestamps; each rank's offset is the smallest gap it sees."""
        self.store.set("job_start", str(job_start_ns))
        deadline = time.monotonic() + timeout_s
        while self.store.add("clk/ready", 0) < self.world and time.monotonic() < deadline:
            time.sleep(0.02)
        self._post_timestamps("clk/go")

    def sync_clock(self, timeout_s: float) -> ClockSync:
        """Rank side of the handshake (the diagnoser rank runs it too: offset ~0)."""
        self.store.add("clk/ready", 1)
        offset = self._min_gap("clk/go", timeout_s)
        job_start = int(bytes(self.store.get("job_start")))
        return ClockSync(offset, job_start)

    def _post_timestamps(self, prefix: str, now_ns: Callable[[], int] = time.monotonic_ns) -> None:
        """Diagnoser side of a handshake: CLOCK_ROUNDS timestamps of its clock, spaced."""
        for k in range(CLOCK_ROUNDS):
            self.store.set(f"{prefix}/{k}", str(now_ns()))
            time.sleep(CLOCK_SPACING_S)

    def _min_gap(self, prefix: str, timeout_s: float) -> int:
        """Our clock minus the diagnoser's: the smallest gap between its posting a
        timestamp and our reading it (each read waits for the post, so the gap is the
        offset plus a delivery delay, and the smallest is the closest)."""
        gaps = []
        for k in range(CLOCK_ROUNDS):
            self.store.wait([f"{prefix}/{k}"], timedelta(seconds=timeout_s))
            now = time.monotonic_ns()
            gaps.append(now - int(bytes(self.store.get(f"{prefix}/{k}"))))
        return min(gaps)

    # ---------------------------------------------------------------- re-sync
    # Later handshakes need no barrier: the diagnoser posts epoch n's timestamps once its
    # clock passes n x period, and each agent waits for them from its tick before then.
    def post_clock_epoch(self, epoch: int, now_ns: Callable[[], int] = time.monotonic_ns) -> None:
        """Diagnoser side: post epoch ``epoch``'s timestamps, read from ``now_ns`` (a
        standby in charge posts the first diagnoser's clock, on which every rank's times
        are); drop those of two back."""
        self._post_timestamps(f"clk/e{epoch}", now_ns)
        for k in range(CLOCK_ROUNDS):
            with contextlib.suppress(Exception):  # gone already, or never posted
                self.store.delete_key(f"clk/e{epoch - 2}/{k}")

    def read_clock_epoch(self, epoch: int, timeout_s: float) -> int:
        """Rank side: our clock minus the diagnoser's, from epoch ``epoch``'s timestamps.
        Raises when they do not come within ``timeout_s``."""
        return self._min_gap(f"clk/e{epoch}", timeout_s)

    # ---------------------------------------------------------------- diagnosis lease
    # One diagnoser emits verdicts at a time: the one diag/owner names. It adds to
    # diag/beat every agent interval (a counter: no two hosts' clocks are compared); a
    # standby that sees the counter stand still takes diag/owner over with compare_set,
    # so that of two claimants one wins.
    def diagnosis_owner(self) -> bytes | None:
        """The owner record of the diagnoser in charge (None before one started)."""
        if not self.store.check(["diag/owner"]):
            return None
        return bytes(self.store.get("diag/owner"))

    def take_diagnosis(self, expected: bytes | None, rank: int, host: str, pid: int) -> bool:
        """Become the diagnoser in charge if the owner record is still ``expected``."""
        mine = owner_record(rank, host, pid)
        old = b"" if expected is None else expected
        return bytes(self.store.compare_set("diag/owner", old, mine)) == mine

    def release_diagnosis(self, owner: bytes) -> None:
        """Say that ``owner`` ended on purpose (the job's normal end): no standby takes
        over from it."""
        self.store.set("diag/released", owner)

    def diagnosis_released(self, owner: bytes) -> bool:
        return (
            bool(self.store.check(["diag/released"]))
            and bytes(self.store.get("diag/released")) == owner
        )

    def renew_lease(self) -> int:
        return int(self.store.add("diag/beat", 1))

    def lease_beat(self) -> int:
        return int(self.store.add("diag/beat", 0))

    def record_reported(self, key: tuple) -> None:
        self.store.append("diag/reported", json.dumps(list(key)) + "\n")

    def reported_keys(self) -> list[tuple]:
        """The keys of the verdicts reported so far (``Verdict.key()``, as tuples)."""
        if not self.store.check(["diag/reported"]):
            return []
        lines = bytes(self.store.get("diag/reported")).decode().splitlines()
        return [(k, c, tuple(r), g) for k, c, r, g in map(json.loads, filter(None, lines))]

    # ---------------------------------------------------------------- who and where
    def publish_who(self, rank: int, who: dict) -> None:
        self.store.set(f"who/{rank}", json.dumps(who))

    def read_who(self, ranks: Iterable[int]) -> dict[int, dict]:
        """Where ``ranks`` run, as they published it; ranks that published nothing are
        left out."""
        return {r: json.loads(v) for r, v in self._read_per_rank("who", ranks).items()}

    # ---------------------------------------------------------------- abort
    def post_abort(self, record: dict) -> None:
        self.store.set("abort", json.dumps(record))

    def read_abort(self) -> dict | None:
        """The abort record once the diagnoser posted one (None before)."""
        if not self.store.check(["abort"]):
            return None
        return json.loads(bytes(self.store.get("abort")))

    def leave_together(self, wait_s: float) -> None:
        """Count this rank out of the aborted job and wait, at most ``wait_s``, until every
        rank has. A rank that may host the store (rank 0, where torchrun's agent does not
        share its own; the diagnoser rank, with a dedicated one) waits a moment more: it
        must not take the store away while the others still look at the count."""
        self.store.add("abort/left", 1)
        deadline = time.monotonic() + wait_s
        while self.store.add("abort/left", 0) < self.world and time.monotonic() < deadline:
            time.sleep(LEAVE_POLL_S)
        if self.rank in (0, self.diagnoser_rank):
            time.sleep(5 * LEAVE_POLL_S)


def owner_record(rank: int, host: str, pid: int) -> bytes:
    return json.dumps({"rank": rank, "host": host, "pid": pid}).encode()


def _listen_on(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``'s address and ``port`` only, for the dedicated
    store (which takes the descriptor over)."""
    errors = []
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as exc:
            sock.close()
            errors.append(f"{addr[0]}: {exc.strerror}")
    raise OSError(
        f"the dedicated store cannot listen on MASTER_ADDR {host}:{port} ({'; '.join(errors)}); "
        "the diagnoser rank must run on that host (diagnoser.rank), or use control.store=auto"
    )


def _own_client(cfg: ControlConfig) -> Any | None:
    """A new client of the job's own TCPStore, or None when the job has none."""
    try:
        store = c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default store: the caller hosts one
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    return dist.TCPStore(
        store.host,
        store.port,
        is_master=False,
        timeout=timedelta(seconds=cfg.connect_timeout_s),
        wait_for_workers=False,
    )
