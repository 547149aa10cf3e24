"""Agent: a daemon thread in every rank that summarizes the board every interval.

It reads the rank's own board (zero-copy), turns it into a :class:`RankSummary` on the
diagnoser's clock, and publishes it through the control plane. Ticks are aligned on the
diagnoser's clock, so all ranks summarize the same stretch of time. It never blocks
training: bounded work per tick, every exception contained, back-off when the store is
unreachable, and it keeps running while the main thread waits inside a collective.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ccld_plugin.agent.board_summary import (
    MIN_SAMPLES,
    BoardSnapshot,
    arrival_samples,
    arrival_source,
    on_device,
    sampled,
    samples_per_group,
    stuck_s,
    summarize_board,
)
from ccld_plugin.agent.node_board import EXITED, STORE_LOST
from ccld_plugin.agent.node_share import NodeShare
from ccld_plugin.agent.recent_steps import RecentSteps
from ccld_plugin.board.job_files import remove_stack, write_crash, write_stack
from ccld_plugin.board.reader import BoardReader
from ccld_plugin.config import AgentConfig
from ccld_plugin.control import ClockSync, ControlPlane, request_timeout_s, resync_epoch
from ccld_plugin.control.reach import ReachPort, route_source
from ccld_plugin.errors import log, report_error
from ccld_plugin.probes.nccl_channels import NcclChannels
from ccld_plugin.probes.tcp_channels import ChannelSampler
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.codes import (
    FLAG_ASYNC,
    FLAG_DEVICE,
    FLAG_P2P,
    FLAG_SEND,
    STATE_DONE,
    TIME_EVENTS,
    TIME_HOST,
)
from ccld_plugin.wire.peer_channels import MAX_ENTRIES, encode_channels, entry_order
from ccld_plugin.wire.summary import (
    FLAG_CRASHED,
    ArrivalSample,
    P2PSample,
    RankSummary,
    StepStat,
    encode_summary,
)

__all__ = ["Agent", "StepClock"]

# A summary also carries its previous tick's samples in jobs of up to this many
# ranks: the store keeps one summary per rank, and one replaced before a round read it (a
# round held up a tick: 3-6% of ticks on a busy 2-core host) took its samples with it;
# a fast job's 10-step span fits in a tick, and lost the arrival order of a whole span.
# Larger jobs' rounds come ticks apart anyway, and repeats would double what they join.
REPEAT_SAMPLES_MAX_RANKS = 4096
# Point-to-point samples per peer, direction and tick (a link's transfers, not every op),
# and per summary in all (a rank that sends to many peers samples each less). At 16, a
# fast two-stage job's 5-step windows (4 to a 1 s tick) took turns at having the 3 a way
# a connection is judged on, and a slow link's verdict took twice as many windows.
MAX_P2P_SAMPLES, P2P_BUDGET = 32, 256
STACK_FRAMES = 16
MAX_BACKOFF_S = 30.0
HOST_STEPS_HELD = 64  # a device-timed rank's host steps held for the device's measure


class StepClock:
    """Step boundaries as the training loop marks them (kept in Python: one append per
    step): the step, its start, and how long the marking thread (the training loop's) had
    by then waited runnable for a CPU outside communication (``cpu_wait_ns``: the tracer's
    ``cpu_wait_outside_ns``; a wait inside an op is already the op's time)."""

    def __init__(self) -> None:
        self.starts: deque[tuple[int, int, int]] = deque(maxlen=1024)
        self.current = -1

    def mark(self, step: int, cpu_wait_ns: int = 0) -> None:
        self.current = step
        self.starts.append((step, time.monotonic_ns(), cpu_wait_ns))


@dataclass(frozen=True)
class LocalReport:
    """What the agent last published (or tried to): a diagnoser in the same process reads
    its own rank from here, so that it sees itself even when the store does not answer."""

    summary: bytes
    groups_version: int
    groups: list[GroupInfo]


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        control: ControlPlane,
        board_path: Any,
        rank: int,
        host: str,
        pid: int,
        tracer: Any,
        steps: StepClock,
        clock_timeout_s: float,
        ranks_per_node: int = 1,
        who: Callable[[], dict] | None = None,
    ) -> None:
        self.cfg = cfg
        self.control = control
        self.rank = rank
        self.host = host
        self.pid = pid
        self.tracer = tracer
        self.steps = steps
        self.clock: ClockSync | None = None
        self._clock_timeout_s = clock_timeout_s
        self._epoch = 0  # the last clock re-sync epoch taken (or skipped)
        self.resyncs = 0
        self._reader = BoardReader(board_path)
        self._board = tracer.board
        self._stop = threading.Event()
        self._last_tick_ns = 0
        self._published_step = -1
        self._groups_version = 0
        self._published_groups: tuple = ()
        self.latest: LocalReport | None = None
        self._recent_steps = RecentSteps()  # the last ticks' steps go in every summary
        self._host_steps: dict[int, StepStat] = {}  # held until the device measured them
        self._sent_tick: int | None = None  # the tick of the last summary
        # its new arrival and point-to-point samples
        self._previous: tuple[list[ArrivalSample], list[P2PSample]] = ([], [])
        self.latest_groups: tuple = ()  # the group signature ``latest`` carries
        # Why the store last failed us (None: it answers); when sending is tried again.
        self.store_lost: str | None = None
        self._retry_at = 0.0
        self._backoff = cfg.interval_s
        self._request_timeout_s = request_timeout_s(cfg.interval_s, clock_timeout_s)
        self._stack_written: tuple[str, ...] = ()  # the stack in the sidecar file, if any
        self._crash: list[str] = []  # the uncaught exception the rank left on
        self._main_ident = threading.main_thread().ident
        # Per-peer TCP progress of this rank (None where the probe cannot run), and the
        # NCCL plugin's channel records on the board (none unless NCCL loaded it).
        self._channels = ChannelSampler.create(self._board, control, rank, control.world)
        self._nccl = NcclChannels()
        # A port the diagnoser connects to when this rank falls silent: the kernel answers
        # it while the process is wedged, not while the link is cut (control.reach).
        self._reach = _open_reach_port(control) if cfg.reach_port else None
        self._reach_published = False
        # Where this rank runs (local rank, device), for the verdicts that name it: sent
        # again when it changes (a device is known once CUDA is initialized).
        self._who = who
        self._who_published: dict | None = None
        # The node's leader publishes this rank's summary in its node's frame; the rank
        # writes its own key only at exit, and while it cannot hand its summary over (no
        # clock handshake: its ticks are not the node's; its summary file not writable).
        self.node = NodeShare(
            self._reader.path, rank, control.world, ranks_per_node, pid, cfg.interval_s, self._stop
        )
        self._synced = False
        self._own_key = False  # whether s/<rank> holds a summary that shadows the frames
        self.leading = False  # whether this rank led its node at its last tick
        self._thread = threading.Thread(target=self._run, name="ccld-agent", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, crash: Sequence[str] = ()) -> None:
        """Publish a last summary that says the rank left through our exit path (on the
        uncaught exception ``crash``, when it has one: also written beside the board)."""
        self._stop.set()
        self._thread.join(timeout=self.cfg.interval_s + 5)
        self._crash = list(crash)
        if crash:
            try:
                write_crash(self._reader.path, self._crash)
            except OSError as exc:
                report_error("agent.crash_file", exc)
        try:
            self._publish(final=True)
        except Exception as exc:  # noqa: BLE001
            report_error("agent.stop", exc)
        if self.store_lost is None:  # else the leader may still publish our last summary
            self.node.remove()
        if self._reach is not None:
            self._reach.close()
        self._reader.close()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        try:
            self.clock = self.control.sync_clock(self._clock_timeout_s)
            self._synced = True
        except Exception as exc:  # noqa: BLE001 - run unsynchronized rather than not at all
            report_error("agent.clock", exc)
            self.clock = ClockSync(0, self._reader.header().start_mono_ns)
        self._board.set_clock_offset(self.clock.offset_ns)
        self._epoch = resync_epoch(self.clock.to_diag(time.monotonic_ns()), self.cfg.clock_resync_s)
        try:  # start-up waited for the store; from now on a request that waits longer
            # than a few intervals waits for a store that is down or cut off
            self.control.set_timeout(self._request_timeout_s)
        except Exception as exc:  # noqa: BLE001
            report_error("agent.store", exc)
        while not self._stop.is_set():
            try:
                self._publish()
            except Exception as exc:  # noqa: BLE001
                report_error("agent.tick", exc)
            if self.store_lost is None:
                self._resync_clock()
            self._stop.wait(self._until_next_tick(self.cfg.interval_s, self._sent_tick))

    # ------------------------------------------------------------------ clock
    def _resync_clock(self) -> None:
        """When the diagnoser's next re-sync falls before our next tick, wait for its
        timestamps and take the new offset (the clocks of two hosts drift apart), unless
        they reached us late (``ClockSync.take``)."""
        period_s = self.cfg.clock_resync_s
        if not period_s or self.clock is None:
            return
        epoch = self._epoch + 1
        due_s = epoch * period_s - self.clock.to_diag(time.monotonic_ns()) / 1e9
        if due_s > self.cfg.interval_s:
            return
        self._epoch = epoch
        try:
            offset = self.control.read_clock_epoch(epoch, max(0.0, due_s) + self.cfg.interval_s)
        except Exception as exc:  # noqa: BLE001 - keep the old offset until the next one
            report_error("agent.clock_resync", exc)
            return
        was = self.clock.offset_ns
        taken = self.clock.take(offset, time.monotonic_ns())
        log.debug(
            "ccld rank %d: clock re-synced, offset %+d us (was %+d us; measured %+d us%s)",
            self.rank,
            self.clock.offset_ns // 1000,
            was // 1000,
            offset // 1000,
            "" if taken else ", late: the earlier estimate stands",
        )
        self._board.set_clock_offset(self.clock.offset_ns)
        self.resyncs += 1

    def _until_next_tick(self, period_s: float, sent: int | None = None) -> float:
        """Seconds to the next multiple of the period on the diagnoser's clock, past the
        tick ``sent`` (the last summary's). One summary a tick: an agent held up for a
        tick sent its summary just before the next boundary, and the next, 10 ms later,
        replaced it unread with the samples of those 10 ms (a straggler's arrival order
        lost for 28 steps)."""
        period = int(period_s * 1e9)
        now = self.clock.to_diag(time.monotonic_ns()) if self.clock else time.monotonic_ns()
        wait = period - now % period
        if sent is not None and self.clock and (now + wait) // period <= sent:
            wait += period
        return wait / 1e9

    def _publish(self, final: bool = False) -> None:
        """Summarize the board, and send the summary unless the store is down and the
        next try is not due. Summaries go on every tick either way: the board and
        ``latest`` (a diagnoser in this process) keep them."""
        self._board.heartbeat()
        groups = self.tracer.groups()
        signature = tuple((g.group_id, g.role) for g in groups)  # a role can be refined
        if signature != self._published_groups and self.latest_groups != signature:
            self._groups_version += 1
            self.latest_groups = signature
        data = encode_summary(self.summarize(final))
        self.latest = LocalReport(data, self._groups_version, groups)
        tick, job_start = self._tick()
        self._sent_tick = tick
        flags = (EXITED if final else 0) | (STORE_LOST if self.store_lost else 0)
        handed = self._synced and self.node.hand(data, tick, job_start, flags)
        now = time.monotonic()
        if now < self._retry_at:
            return
        try:
            if signature != self._published_groups:
                self.control.publish_groups(self.rank, groups, self._groups_version)
                self._published_groups = signature
            if self._reach is not None and not self._reach_published:
                self.control.publish_reach(self.rank, self._reach.address)
                self._reach_published = True
            who = self._who() if self._who is not None else None
            if who is not None and who != self._who_published:
                self.control.publish_who(self.rank, who)
                self._who_published = who
            self._send(data, tick, job_start, handed and not final, final)
        except Exception as exc:  # noqa: BLE001
            if self.store_lost is None:
                log.warning(
                    "ccld rank %d: the store does not answer (%s); training goes on, the "
                    "board keeps this rank's record (read it with: ccld diagnose <board "
                    "dir>), and sending is retried with backoff",
                    self.rank,
                    (str(exc).splitlines() or [type(exc).__name__])[0][:160],
                )
                self._backoff = self.cfg.interval_s
            self.store_lost = f"{type(exc).__name__}"
            self._retry_at = now + self._backoff
            self._backoff = min(2 * self._backoff, MAX_BACKOFF_S)
            report_error("agent.publish", exc)
            return
        if self.store_lost is not None:
            log.warning("ccld rank %d: the store answers again", self.rank)
        self.store_lost = None

    def _tick(self) -> tuple[int, int]:
        """This tick's number on the diagnoser's clock (the same on every rank) and the
        job's start (the same for every rank of this run)."""
        if self.clock is None:
            return 0, 0
        period = int(self.cfg.interval_s * 1e9)
        return round(self.clock.to_diag(time.monotonic_ns()) / period), self.clock.job_start_ns

    def _send(self, data: bytes, tick: int, job_start: int, handed: bool, final: bool) -> None:
        """The store's part of a tick: the node's frame where this rank leads its node,
        nothing more where another rank does (a request now and then while the store
        failed us, to tell when it answers again), and its own key where its summary was
        not handed over, where the node is not as configured (``NodeShare.leader``), and
        at exit."""
        if final and self.leading:
            # The node's last frame from this leader: a node-mate that died before it
            # left is told as its board stood then (NodeShare.frame); this rank's own
            # key below shadows its part. (A rank's death takes its gloo peers down at
            # once, the leader among them, before its next tick.)
            self.control.publish_node(self.node.node, self.node.frame(data, tick, job_start))
        leader = self.node.leader(tick, job_start) if handed else None
        # Set once the tick's role is known, not reset first: others read it while the
        # store call below is in flight.
        self.leading = leader == self.rank
        if leader is None:
            self.control.publish(self.rank, data)
            self._own_key = True
            return
        if self._own_key:
            self.control.withdraw(self.rank)
            self._own_key = False
        if leader == self.rank:
            self.control.publish_node(self.node.node, self.node.frame(data, tick, job_start))
        elif self.store_lost is not None:
            self.control.ping()

    # ------------------------------------------------------------------ summary
    def summarize(self, final: bool = False) -> RankSummary:
        now = time.monotonic_ns()
        clock = self.clock or ClockSync(0, 0)
        snap = BoardSnapshot.read(self._reader)
        since = self._last_tick_ns
        self._last_tick_ns = now
        summary = summarize_board(
            snap, now, since, clock.offset_ns, self._groups_version, exited=final
        )
        # The board keeps 63 bytes of the host name; the diagnoser matches the full one.
        summary.host = self.host
        ops = snap.ops
        done = on_device(ops[(ops["state"] == STATE_DONE) & (ops["exit_ns"] > since)])
        summary.steps = self._step_stats(ops, clock.to_diag)
        device = TIME_EVENTS if getattr(self.tracer, "timeline", None) is not None else TIME_HOST
        summary.time_source = device | arrival_source(done) << 4
        new, new_p2p = self._samples(done, clock.to_diag), self._p2p_samples(done, clock.to_diag)
        summary.samples, summary.p2p = self._previous[0] + new, self._previous[1] + new_p2p
        if self.control.world <= REPEAT_SAMPLES_MAX_RANKS:
            self._previous = (new, new_p2p)
        summary.channels = self._channel_evidence(now)
        summary.stack = self._stack(stuck_s(summary))
        if final and self._crash:
            summary.flags |= FLAG_CRASHED
            summary.stack = self._crash
        return summary

    def _stack(self, stuck_for_s: float) -> list[str]:
        """The main thread's stack once the rank is stuck long enough, also written beside
        the board for the post-mortem; the sidecar goes when the rank moves again."""
        if stuck_for_s < self.cfg.stack_after_s:
            if self._stack_written:
                remove_stack(self._reader.path)
                self._stack_written = ()
            return []
        stack = self._main_stack()
        if tuple(stack) != self._stack_written:
            try:
                write_stack(self._reader.path, stack)
                self._stack_written = tuple(stack)
            except OSError as exc:
                report_error("agent.stack_file", exc)
        return stack

    def _channel_evidence(self, now_ns: int) -> bytes:
        """The summary's per-peer channel entries: NCCL channels and TCP connections."""
        tcp = self._channels.sample() if self._channels else None
        try:
            nccl = self._nccl.sample(self._reader.channels(), now_ns)
        except Exception as exc:  # noqa: BLE001 - no NCCL evidence, training goes on
            report_error("probes.nccl_channels", exc)
            nccl = []
        if tcp is None and not nccl:
            return b""
        entries = sorted([*nccl, *(tcp.entries if tcp else [])], key=entry_order)
        interval = tcp.interval_s if tcp and tcp.interval_s > 0 else self.cfg.interval_s
        conns = (tcp.conns if tcp else 0) + sum(e.conns for e in nccl)
        return encode_channels(entries[:MAX_ENTRIES], interval, conns)

    def _step_stats(self, ops: np.ndarray, diag: Any) -> list[StepStat]:
        """The steps new this tick (and the last ticks', ``RecentSteps``): on host clocks,
        or, where the device timeline measures them, on the device's (``_device_steps``)."""
        host = self._host_step_stats(ops, diag)
        timeline = getattr(self.tracer, "timeline", None)
        steps = host if timeline is None else self._device_steps(timeline, host, diag)
        return self._recent_steps.tick(steps)

    def _device_steps(self, timeline: Any, host: list[StepStat], diag: Any) -> list[StepStat]:
        """The steps the device timeline measured since the last tick: their span between
        the device's step marks, their compute outside the current stream's waits in
        communication, beside the host's own measure of the step (held until the device
        has measured it; a step the device cannot measure is not reported)."""
        self._host_steps.update((st.step, st) for st in host)
        out = []
        for d in timeline.take_steps():
            h = self._host_steps.pop(d.step, None)
            out.append(
                StepStat(
                    d.step,
                    diag(d.start_ns),
                    d.span_ns // 1000,
                    (d.span_ns - d.blocked_ns) // 1000,
                    0,  # a wait for a CPU is the host's: on a device it shows as compute
                    h.compute_us if h is not None else 0,
                )
            )
        for step in sorted(self._host_steps)[:-HOST_STEPS_HELD]:
            del self._host_steps[step]
        return out

    def _host_step_stats(self, ops: np.ndarray, diag: Any) -> list[StepStat]:
        starts = list(self.steps.starts)
        stats = []
        # the host's time blocked in communication: on a device it is blocked at sync points
        # instead, and a device-timed op's own time is the device's
        sync_done = ops[
            (ops["state"] == STATE_DONE) & ((ops["flags"] & (FLAG_ASYNC | FLAG_DEVICE)) == 0)
        ]
        waits = self.tracer.take_wait_ns(before_step=starts[-1][0] if starts else 0)
        for (step, t0, q0), (_, t1, q1) in zip(starts, starts[1:], strict=False):
            if step <= self._published_step:
                continue
            mine = sync_done[sync_done["step"] == step]
            blocked = int(
                (np.minimum(mine["exit_ns"], t1) - np.maximum(mine["enter_ns"], t0))
                .clip(min=0)
                .sum()
            )
            blocked += waits.get(step, 0)
            # queued for a CPU outside communication: the host's time, not the rank's compute
            queued = min(max(0, q1 - q0), max(0, t1 - t0 - blocked))
            compute = max(0, t1 - t0 - blocked - queued)
            stats.append(
                StepStat(step, diag(t0), (t1 - t0) // 1000, compute // 1000, queued // 1000)
            )
        if stats:
            self._published_step = stats[-1].step
        return stats

    def _samples(self, done: np.ndarray, diag: Any) -> list[ArrivalSample]:
        """Arrival samples of the collectives completed this tick (``arrival_samples``)."""
        return arrival_samples(done, samples_per_group(self.control.world), diag)

    def _p2p_samples(self, done: np.ndarray, diag: Any) -> list[P2PSample]:
        """Point-to-point samples: per group, peer and direction, some of the sends
        (receives) completed this tick, picked by their seq as for collectives; the peer's
        receives (sends) of those seqs are picked the same way, so the diagnoser can pair
        the two ends of each message."""
        p2p = done[((done["flags"] & FLAG_P2P) != 0) & (done["peer"] >= 0)]
        if not len(p2p):
            return []
        sends = (p2p["flags"] & FLAG_SEND) != 0
        keys = np.unique(
            np.stack([p2p["group_slot"], p2p["peer"], sends], axis=1).astype(np.int64), axis=0
        )
        keep = max(
            MIN_SAMPLES,
            min(MAX_P2P_SAMPLES, samples_per_group(self.control.world), P2P_BUDGET // len(keys)),
        )
        out = []
        for slot, peer, send in keys.tolist():
            mine = p2p[(p2p["group_slot"] == slot) & (p2p["peer"] == peer) & (sends == send)]
            out += [
                P2PSample(
                    slot,
                    peer,
                    bool(send),
                    int(r["seq"]),
                    diag(int(r["enter_ns"])),
                    int((r["exit_ns"] - r["enter_ns"]) // 1000),
                    int(r["bytes"]),
                )
                for r in sampled(mine, keep)
            ]
        return out

    def _main_stack(self) -> list[str]:
        ident = self._main_ident  # None only for a main thread not started (never, here)
        frame = sys._current_frames().get(ident) if ident is not None else None
        if frame is None:
            return []
        return [
            f"{f.filename}:{f.lineno} in {f.name}"
            for f in traceback.extract_stack(frame)[-STACK_FRAMES:]
        ]


def _open_reach_port(control: ControlPlane) -> ReachPort | None:
    """This rank's reach port, on the address it sends from toward the store (the network
    the diagnoser is on); None, logged once, where it cannot be opened."""
    try:
        return ReachPort(route_source(*control.address))
    except Exception as exc:  # noqa: BLE001 - no reach port: a silent rank stays ambiguous
        report_error("agent.reach", exc)
        return None
