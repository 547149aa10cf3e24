"""A local job as a real multi-host job: every rank in its own network namespace.

:class:`NetJob` wraps a :class:`~ccld_harness.launch.LocalJob` and runs it inside a
:class:`~ccld_harness.faults.netns.ClosedNetwork`: rank r in its namespace with its own
address, MASTER_ADDR = rank 0's address, gloo on the rank's ``eth0``. Communication
faults are applied from outside, on the rank's link, when the rank reaches the fault's
step: ``comm-slow`` shapes it (``tc`` tbf), ``comm-hang`` cuts it. ``comm-slow`` with a
``peer`` shapes one connection only: the traffic between the rank and that peer goes
through a tbf of its own (an htb class picked by a u32 filter on the peer's address), the
rest of the rank's link is left alone.

The launcher talks to the job only through files: it watches the steps on the rank
boards and appends each fault's onset to the fault log (the format of
``ccld_harness.faults.inject``), with ``onset_s`` on the diagnoser's clock. The launcher
runs on the same host, so CLOCK_MONOTONIC is shared; the diagnoser's job start is taken
from the diagnoser rank's board header (``start_mono_ns``), which the rank writes a few
milliseconds before its session's ``started_ns`` (the verdicts' time base).

The network is removed when the job stops, however it stops (``stop``, ``with`` exit, and
the network's own exit and signal hooks).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from ccld_harness.faults import netns
from ccld_harness.faults.netns import RANK_IFNAME, ClosedNetwork, NetnsError, available
from ccld_harness.faults.spec import FaultSpec
from ccld_harness.launch import LocalJob
from ccld_plugin.board.job_files import board_file
from ccld_plugin.board.reader import BoardError, BoardReader

__all__ = ["NetJob", "NetnsError", "available"]

POLL_S = 0.02  # how often the boards are read while a fault waits for its step


class NetJob:
    """``job`` in a closed network, with the communication ``faults`` applied at their step.

    ``boards`` is the job's board directory (``<board.dir>/<job>``); ``fault_log`` the
    JSONL file onsets are appended to; ``diagnoser_rank`` the rank whose board start is the
    job's start on the diagnoser's clock.
    """

    def __init__(
        self,
        job: LocalJob,
        faults: Sequence[FaultSpec],
        boards: Path,
        fault_log: Path | None = None,
        diagnoser_rank: int = 0,
    ) -> None:
        self.job = job
        self.faults = [f for f in faults if f.is_comm]
        self.boards = Path(boards)
        self.fault_log = fault_log
        self.diagnoser_rank = diagnoser_rank
        self.net: ClosedNetwork | None = None
        self.applied: list[dict] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def world(self) -> int:
        return self.job.world

    @property
    def procs(self) -> list:
        return self.job.procs

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> NetJob:
        if self.job.stop_requested():  # a stop signal came first: build nothing
            return self
        ok, why = available()
        if not ok:
            raise NetnsError(f"communication faults need a closed network: {why}")
        self.net = ClosedNetwork(self.job.world).open()
        try:
            self.job.rank_prefix = self.net.exec_prefix
            self.job.master_addr = self.net.address(0)
            self.job.env = {**self.job.env, "GLOO_SOCKET_IFNAME": RANK_IFNAME}
            self.job.start()
        except BaseException:
            self._teardown()
            raise
        if self.faults:
            self._watcher = threading.Thread(target=self._watch, name="ccld-netjob", daemon=True)
            self._watcher.start()
        return self

    def poll(self) -> list[int | None]:
        return self.job.poll()

    def running(self) -> bool:
        return self.job.running()

    def wait(self, timeout_s: float) -> bool:
        return self.job.wait(timeout_s)

    def stop(self, grace_s: float = 3.0) -> list[int | None]:
        """End the ranks, then remove the network; returns the ranks' exit codes."""
        self._stop.set()
        try:
            return self.job.stop(grace_s)
        finally:
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            self._teardown()

    def _teardown(self) -> None:
        if self.net is not None:
            self.net.close()

    def __enter__(self) -> NetJob:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ faults
    def _watch(self) -> None:
        pending = list(self.faults)
        readers: dict[int, BoardReader] = {}
        reached: dict[FaultSpec, float] = {}  # when the fault's rank reached its step
        try:
            while pending and not self._stop.is_set():
                for f in list(pending):
                    step = self._step(readers, f.rank)
                    if step is None or step < f.step:
                        continue
                    reached.setdefault(f, time.monotonic())
                    if time.monotonic() - reached[f] >= f.after_s:
                        pending.remove(f)
                        self._apply(f, step, readers)
                self._stop.wait(POLL_S)
        finally:
            for r in readers.values():
                r.close()

    def _reader(self, readers: dict[int, BoardReader], rank: int) -> BoardReader | None:
        if rank not in readers:
            path = board_file(self.boards, rank)
            if not path.exists():
                return None
            try:
                readers[rank] = BoardReader(path)
            except BoardError:
                return None  # being created: try again next poll
        return readers[rank]

    def _step(self, readers: dict[int, BoardReader], rank: int) -> int | None:
        r = self._reader(readers, rank)
        return r.header().step if r is not None else None

    def _apply(self, fault: FaultSpec, step: int, readers: dict[int, BoardReader]) -> None:
        assert self.net is not None
        try:
            if fault.kind == "comm-slow" and fault.peer is not None:
                shape_pair(self.net, fault.rank, fault.peer, fault.rate)
            elif fault.kind == "comm-slow":
                self.net.shape(fault.rank, fault.rate)
            else:
                self.net.cut(fault.rank)
        except (NetnsError, RuntimeError) as exc:
            self.errors.append(f"{fault}: {exc}")
            return
        now = time.monotonic_ns()
        diag = self._reader(readers, self.diagnoser_rank)
        start = diag.header().start_mono_ns if diag is not None else None
        entry = {
            "fault": str(fault),
            "kind": fault.kind,
            "rank": fault.rank,
            "step": step,
            "onset_s": round((now - start) / 1e9, 3) if start else None,
            "onset_mono_ns": now,
            "wall_time": time.time(),
            "applied_by": "netjob",
        }
        self.applied.append(entry)
        if self.fault_log is not None:
            with contextlib.suppress(OSError):
                self.fault_log.parent.mkdir(parents=True, exist_ok=True)
                with open(self.fault_log, "a") as fh:
                    fh.write(json.dumps(entry) + "\n")


def shape_pair(
    net: ClosedNetwork,
    rank: int,
    peer: int,
    rate: str,
    *,
    burst: str = "32kb",
    latency_ms: int = 50,
) -> None:
    """Limit the traffic between ``rank`` and ``peer`` to ``rate`` in both directions, with
    the tbf of :meth:`ClosedNetwork.shape`, and nothing else of either rank's link: on both
    ends of ``rank``'s veth an htb root sends everything to an unlimited class, except the
    packets to (rank egress) or from (switch egress) ``peer``'s address, which a u32 filter
    puts in a class whose queue is the tbf. Removed with the namespaces."""
    tbf = ["tbf", "rate", rate, "burst", burst, "latency", f"{latency_ms}ms"]
    wide = ["htb", "rate", "10gbit", "quantum", "60000"]  # neither class limits by itself
    peer_ip = net.address(peer)
    ends = [
        (net.netns(rank), RANK_IFNAME, "dst"),  # rank -> peer
        (net.switch_netns, net.switch_port(rank), "src"),  # peer -> rank
    ]
    for ns, dev, side in ends:
        tc = ["-n", ns]
        netns._tc(
            *tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1"
        )
        netns._tc(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", *wide)
        netns._tc(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:2", *wide)
        netns._tc(*tc, "qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", *tbf)
        netns._tc(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                  "u32", "match", "ip", side, f"{peer_ip}/32", "flowid", "1:2")  # fmt: skip
