"""Control plane: torch's TCPStore, under a ``ccld/<job>/`` prefix.

The job's own store when there is one (torchrun's agent store even survives a hung
worker), else a dedicated TCPStore hosted by the diagnoser rank. Keys:

- ``s/<rank>``: the rank's latest summary (overwritten every tick);
- ``g/<rank>``: the rank's group table, rewritten when it changes;
- ``clk/...``: the clock handshake; ``job_start``: the diagnoser's start time;
- ``ep/<rank>``: the (ip, port) local ends of the rank's TCP connections, which peers join
  with their remote ends to map connections to ranks (rewritten when they change).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ccld_plugin.config import ControlConfig
from ccld_plugin.wire.topology import GroupInfo

__all__ = ["ClockSync", "ControlPlane", "resync_epoch"]

# A handshake's timestamps: each rank's offset is the smallest gap it sees between a post
# and its read, so a rank that is not running when one comes (descheduled, or its agent
# waiting for the GIL) reads it late. Five posts 10 ms apart all came late to some ranks
# of a loaded host: offsets of 5-16 ms on one host (true offset 0), more than the arrival
# skew of a TP collective. Spread over half a second, one post is likely caught at once.
CLOCK_ROUNDS = 10
CLOCK_SPACING_S = 0.05
# Quartz oscillators are specified to +-20..100 ppm; NTP-disciplined hosts stay within a few.
MAX_DRIFT_PPM = 100


def resync_epoch(diag_ns: int, period_s: float) -> int:
    """Clock re-sync periods passed at ``diag_ns`` on the diagnoser's clock (0 when off):
    epoch n's timestamps are posted once its clock passes n x period."""
    return int(diag_ns // int(period_s * 1e9)) if period_s else 0


class ClockSync:
    """This rank's monotonic clock against the diagnoser's: ``offset_ns`` is ours minus
    theirs; ``job_start_ns`` is the diagnoser's start, on its clock."""

    def __init__(self, offset_ns: int, job_start_ns: int) -> None:
        self.offset_ns = offset_ns
        self.job_start_ns = job_start_ns
        # The best handshake so far and when it was taken (our clock): a measured offset
        # is the truth plus a delivery delay, so lower is better, up to the clocks' drift.
        self._best = (offset_ns, time.monotonic_ns())

    def take(self, measured_ns: int, now_ns: int) -> bool:
        """A re-sync's measured offset. It replaces the best one unless that one, aged by
        the most the clocks can have drifted since (MAX_DRIFT_PPM), is still lower: then
        this handshake's posts reached us late and the aged estimate stands. True when
        the measurement was taken."""
        best, at = self._best
        aged = best + (now_ns - at) * MAX_DRIFT_PPM // 1_000_000
        if measured_ns <= aged:
            self._best = (measured_ns, now_ns)
            self.offset_ns = measured_ns
            return True
        self.offset_ns = aged
        return False

    def to_diag(self, mono_ns: int) -> int:
        return mono_ns - self.offset_ns

    def job_seconds(self, mono_ns: int) -> float:
        return (mono_ns - self.offset_ns - self.job_start_ns) / 1e9


class ControlPlane:
    def __init__(
        self, cfg: ControlConfig, rank: int, world: int, job: str, diagnoser_rank: int
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world = world
        self.diagnoser_rank = diagnoser_rank
        self.store_prefix = f"{cfg.prefix}{job}/"
        # A connection of our own: a blocking call of the training loop on the job's
        # client (gloo's rendezvous) must never hold up a heartbeat, nor ours the job.
        base = _own_client(cfg) if cfg.store == "auto" else None
        if base is None:
            base = self._dedicated_store()
        self.store = dist.PrefixStore(self.store_prefix, base)

    def connect(self) -> ControlPlane:
        """Another control plane over a new connection (one per thread that blocks)."""
        other = object.__new__(ControlPlane)
        other.__dict__.update(self.__dict__)
        base = _own_client(self.cfg) if self.cfg.store == "auto" else None
        if base is None:
            host, port = self._dedicated_address()
            base = dist.TCPStore(
                host,
                port,
                self.world,
                False,
                timedelta(seconds=self.cfg.connect_timeout_s),
                wait_for_workers=False,
            )
        other.store = dist.PrefixStore(self.store_prefix, base)
        return other

    def _dedicated_address(self) -> tuple[str, int]:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        return host, self.cfg.port or int(os.environ.get("MASTER_PORT", "29500")) + 1

    def _dedicated_store(self) -> Any:
        host, port = self._dedicated_address()
        hosting = self.rank == self.diagnoser_rank
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
    def publish(self, rank: int, summary: bytes) -> None:
        self.store.set(f"s/{rank}", summary)  # type: ignore[arg-type]  # bytes are stored as is

    def read_summaries(self, ranks: Iterable[int]) -> dict[int, bytes]:
        """Latest summaries of ``ranks``; ranks that never published are left out."""
        return self._read_per_rank("s", ranks)

    def _read_per_rank(self, prefix: str, ranks: Iterable[int]) -> dict[int, bytes]:
        """The values of ``<prefix>/<rank>`` that exist, read in chunks (one multi_get of
        many keys is slower than several of a few hundred)."""
        ranks = list(ranks)
        present = [
            r
            for r, ok in zip(ranks, self._exist([f"{prefix}/{r}" for r in ranks]), strict=True)
            if ok
        ]
        out: dict[int, bytes] = {}
        step = self.cfg.chunk_keys
        for i in range(0, len(present), step):
            chunk = present[i : i + step]
            for r, value in zip(
                chunk, self.store.multi_get([f"{prefix}/{r}" for r in chunk]), strict=True
            ):
                out[r] = bytes(value)
        return out

    def _exist(self, keys: list[str]) -> list[bool]:
        # check() answers for all keys at once; ask key by key only when some are missing.
        if self.store.check(keys):
            return [True] * len(keys)
        return [self.store.check([k]) for k in keys]

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

    def _post_timestamps(self, prefix: str) -> None:
        """Diagnoser side of a handshake: CLOCK_ROUNDS timestamps of its clock, spaced."""
        for k in range(CLOCK_ROUNDS):
            self.store.set(f"{prefix}/{k}", str(time.monotonic_ns()))
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
    def post_clock_epoch(self, epoch: int) -> None:
        """Diagnoser side: post epoch ``epoch``'s timestamps; drop those of two back."""
        self._post_timestamps(f"clk/e{epoch}")
        for k in range(CLOCK_ROUNDS):
            with contextlib.suppress(Exception):  # gone already, or never posted
                self.store.delete_key(f"clk/e{epoch - 2}/{k}")

    def read_clock_epoch(self, epoch: int, timeout_s: float) -> int:
        """Rank side: our clock minus the diagnoser's, from epoch ``epoch``'s timestamps.
        Raises when they do not come within ``timeout_s``."""
        return self._min_gap(f"clk/e{epoch}", timeout_s)


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
