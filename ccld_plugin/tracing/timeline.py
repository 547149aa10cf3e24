"""A rank's device timeline: when the device reached each traced op and finished it there,
and how long each step ran on the device outside communication.

The training thread only records events (``arrive``: a pre-made timing event from a ring,
recorded on the current stream) and hands them over; it never waits. The poller thread
resolves them: ``query()`` until the device has reached an event, then its device time
mapped to the host's monotonic clock through an *anchor*, an event recorded on a stream
that runs nothing else, whose device time lies between the host times just before its
record and when it was seen complete (``ANCHOR_PERIOD_NS`` apart, the narrowest kept).
Each event also bounds its own time: after the host recorded it, before the poller saw it
complete; a mapped time outside those bounds means the device clock jumped (or drifted
away): it is clamped to them, and the anchor taken again.

Per op (board records flagged FLAG_DEVICE): its start is the event recorded on the current
stream before the call (the device reached the op), its end the event after it for a
blocking op (the current stream waited for the collective), or, for async work, its start
plus the work's own device duration (``work._get_duration()``), else the host time the
work was seen complete. Per step: the span between the device's step marks, less the time
the current stream waited in blocking ops and in ``wait()`` on async work.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ccld_plugin.errors import report_error
from ccld_plugin.tracing.device import DeviceKind
from ccld_plugin.wire.codes import (
    STATE_DONE,
    STATE_ERROR,
    TIME_EVENTS,
    TIME_POLL,
    TIME_WORK,
)

__all__ = ["POLL_NS", "DeviceOp", "DeviceStep", "DeviceTimeline"]

RING = 4096  # timing events per rank: an op waiting for one when none is free goes untimed
ANCHOR_PERIOD_NS = 1_000_000_000  # a new anchor this often (the clocks drift apart)
ANCHOR_MAX_AGE_NS = 10 * ANCHOR_PERIOD_NS  # ... taken even if wider than the one it replaces
ANCHOR_SPIN_NS = 200_000  # the poller waits this long for an anchor, then looks later
MIN_ERR_NS = 20_000  # an anchor as narrow as this is as good as any
JUMP_SLACK_NS = 100_000  # a mapped time this far outside its bounds: the clock moved
STEPS_KEPT = 256  # steps waiting for their events; older ones are given up
GIVE_UP_NS = 30_000_000_000  # an op's events unmapped this long are left as they are
# A poll looks at the ops this often: an op's events are read once or twice, not at every
# turn of the poller (its exit is stamped up to this late; its device times are the
# device's, however late they are read); and only so far behind ops not done (_advance).
POLL_NS = 50_000_000
AHEAD_UNDONE, FULL_SCAN_POLLS = 8, 10


class DeviceStep(NamedTuple):
    """One step on the device: its start (host monotonic clock), its span to the next
    step mark, the time the current stream waited in communication, the mapping error."""

    step: int
    start_ns: int
    span_ns: int
    blocked_ns: int
    err_ns: int


@dataclass(eq=False, slots=True)
class DeviceOp:
    """A traced op the device timeline follows: its board records, its step, the event
    before it, the event after it (a blocking op) or its works (async ones)."""

    indices: tuple[int, ...]
    step: int
    pre: int
    post: int = -1
    works: list[tuple[int, Any]] = field(default_factory=list)  # (board index, work)
    since_ns: int = 0  # when the poller took it
    start: tuple[int, int, int] | None = None  # (time, error, source) once mapped
    end: tuple[int, int, int] | None = None  # a blocking op's
    exited: bool = False
    done_ns: dict[int, tuple[int, float | None, bool]] = field(default_factory=dict)


@dataclass
class _StepBook:
    start: int | None = None
    err: int = 0
    next_step: int | None = None
    blocked: int = 0
    pending: int = 0
    broken: bool = False


class DeviceTimeline:
    """The device timeline of one rank (one device kind), writing to its board."""

    def __init__(
        self,
        kind: DeviceKind,
        board: Any,
        exit_many: Callable[[tuple[int, ...], int], None],
        ring: int = RING,
    ) -> None:
        self.kind = kind
        self._board = board
        self._exit_many = exit_many
        self._ring = ring
        self._events: list[Any] = []
        self._rec_ns: list[int] = []
        self._seen_ns: list[int] = []
        self._free: deque[int] = deque()
        self._incoming: deque[tuple] = deque()  # from the training thread to the poller
        self._ops: list[DeviceOp] = []
        self._spans: list[tuple[int, int, int]] = []  # (step, w0, w1): waits in wait()
        self._marks: list[tuple[int, int]] = []  # (step, event) step marks to map
        self._steps: dict[int, _StepBook] = {}
        self._last_mark: int | None = None
        self._done: deque[DeviceStep] = deque(maxlen=STEPS_KEPT)
        self._anchor: tuple[Any, int, int, int] | None = None  # (event, time, error, taken)
        self._tried_ns = 0  # when a new anchor was last tried
        self._trial: tuple[Any, int] | None = None  # an anchor recorded, not yet seen
        self._spare: list[Any] = []
        self._reanchor = False
        self._polls, self._polled_ns = 0, 0
        self.skipped = 0  # events not recorded: the ring was full
        self.jumps = 0  # mapped times outside their bounds: the device clock moved

    # ------------------------------------------------------------ training thread
    def arrive(self, step: int) -> int:
        """Record an event on the current stream; its slot, or -1 when the ring is full
        (the op goes untimed, and ``step`` cannot be measured on the device)."""
        try:
            slot = self._free.popleft()
        except IndexError:
            slot = self._grow()
            if slot < 0:
                self.skipped += 1
                self._incoming.append(("skip", step))
                return -1
        self._rec_ns[slot] = time.monotonic_ns()
        try:
            self._events[slot].record()
        except Exception as exc:  # noqa: BLE001 - e.g. a stream under graph capture
            report_error("device.record", exc)
            self._free.append(slot)
            self._incoming.append(("skip", step))
            return -1
        return slot

    def _grow(self) -> int:
        if len(self._events) >= self._ring:
            return -1
        self._events.append(self.kind.new_event())
        self._rec_ns.append(0)
        self._seen_ns.append(0)
        return len(self._events) - 1

    def mark(self, step: int) -> None:
        """The training thread starts ``step``: a mark on the device's stream."""
        slot = self.arrive(step)
        if slot >= 0:
            self._incoming.append(("mark", step, slot))

    def follow(self, op: DeviceOp) -> None:
        self._incoming.append(("op", op))

    def waited_from(self, step: int, w0: int) -> None:
        """The current stream has waited on async work since the event ``w0`` (-1: not
        recorded): an event now ends the wait, booked to ``step``."""
        w1 = self.arrive(step) if w0 >= 0 else -1
        if w1 >= 0:
            self._incoming.append(("wait", step, w0, w1))
        elif w0 >= 0:
            self._seen_ns[w0] = 0  # never handed over: the training thread frees it
            self._free.append(w0)

    # ------------------------------------------------------------ poller thread
    def poll(self) -> None:
        """Resolve what the device has done since the last poll (never blocks)."""
        now = time.monotonic_ns()
        if now - self._polled_ns < POLL_NS // 2:  # (the poller wakes a little early too)
            return
        self._polled_ns = now
        self._take_incoming(now)
        self._keep_anchor(now)
        self._polls += 1
        self._ops = self._advance(self._ops, now, self._polls % FULL_SCAN_POLLS == 0)
        self._spans = [w for w in self._spans if not self._resolve_wait(w, now)]
        self._marks = [m for m in self._marks if not self._resolve_mark(m, now)]
        self._finish_steps()

    def _advance(self, ops: list[DeviceOp], now: int, full: bool) -> list[DeviceOp]:
        """The ops not finished with after advancing them, oldest first. The device runs
        a stream in order: behind AHEAD_UNDONE ops it has not done, the later ones are
        looked at only on a full scan (every FULL_SCAN_POLLS polls: the ops of another
        stream, which may run ahead)."""
        left: list[DeviceOp] = []
        for i, op in enumerate(ops):
            if not full and len(left) >= AHEAD_UNDONE:
                return left + ops[i:]
            if not self._resolve(op, now):
                left.append(op)
        return left

    def take_steps(self) -> list[DeviceStep]:
        """The steps measured since the last call, oldest first."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def _take_incoming(self, now: int) -> None:
        while self._incoming:
            item = self._incoming.popleft()
            kind = item[0]
            if kind == "op":
                op = item[1]
                op.since_ns = now
                self._ops.append(op)
                if op.post >= 0:
                    self._book(op.step).pending += 1
            elif kind == "wait":
                self._spans.append(item[1:])
                self._book(item[1]).pending += 1
            elif kind == "mark":
                _, step, slot = item
                self._marks.append((step, slot))
                if self._last_mark is not None and self._last_mark in self._steps:
                    self._steps[self._last_mark].next_step = step
                self._book(step)
                self._last_mark = step
            else:  # skip
                self._book(item[1]).broken = True

    def _book(self, step: int) -> _StepBook:
        book = self._steps.get(step)
        if book is None:
            book = self._steps[step] = _StepBook()
            while len(self._steps) > STEPS_KEPT:
                self._steps.pop(next(iter(self._steps)))
        return book

    # ------------------------------------------------------------ the clock anchor
    def _keep_anchor(self, now: int) -> None:
        """Take a new anchor when due: record an event on the idle stream and wait for it
        at most ANCHOR_SPIN_NS here; one that takes longer is looked at on later polls."""
        if self._trial is not None:
            event, h0 = self._trial
            if self._query(event):
                self._trial = None
                self._take_anchor(event, h0, time.monotonic_ns())
            return
        due = self._anchor is None or self._reanchor
        if not due and now - self._tried_ns < ANCHOR_PERIOD_NS:
            return
        self._tried_ns = now
        try:
            event = self._spare.pop() if self._spare else self.kind.new_event()
            stream = self.kind.anchor_stream()
            h0 = time.monotonic_ns()
            event.record(stream)
            while time.monotonic_ns() - h0 < ANCHOR_SPIN_NS:
                if event.query():
                    self._take_anchor(event, h0, time.monotonic_ns())
                    return
                time.sleep(0)
        except Exception as exc:  # noqa: BLE001
            report_error("device.anchor", exc)
            return
        self._trial = (event, h0)

    def _take_anchor(self, event: Any, h0: int, h1: int) -> None:
        err = (h1 - h0) // 2
        old = self._anchor
        if (
            old is None
            or self._reanchor
            or err <= max(MIN_ERR_NS, 2 * old[2])
            or h1 - old[3] >= ANCHOR_MAX_AGE_NS
        ):
            if old is not None:
                self._spare.append(old[0])
            self._anchor = (event, h0 + err, err, h1)
            self._reanchor = False
        else:  # wider than the one we have: kept for the next try
            self._spare.append(event)

    def _map(self, slot: int) -> tuple[int, int, int] | None:
        """A completed event's host time, error and source (None: no anchor yet, or the
        one there is was caught off, and a new one is on its way)."""
        anchor = self._anchor
        if anchor is None or self._reanchor:
            return None
        event, t_anchor, err, _ = anchor
        try:
            t = t_anchor + round(event.elapsed_time(self._events[slot]) * 1e6)
        except Exception as exc:  # noqa: BLE001
            report_error("device.elapsed", exc)
            return None
        lo, hi = self._rec_ns[slot], self._seen_ns[slot]
        if t < lo - err - JUMP_SLACK_NS or t > hi + err + JUMP_SLACK_NS:
            self.jumps += 1
            self._reanchor = True
            return min(max(t, lo), hi), hi - lo, TIME_EVENTS
        return min(max(t, lo - err), hi + err), err, TIME_EVENTS

    def _query(self, event: Any) -> bool:
        try:
            return bool(event.query())
        except Exception as exc:  # noqa: BLE001
            report_error("device.query", exc)
            return False

    def _seen(self, slot: int, now: int) -> bool:
        """Whether the device has reached the event in ``slot`` (stamped when first seen:
        after the query, which bounds the event's time from above)."""
        if self._seen_ns[slot]:
            return True
        if not self._query(self._events[slot]):
            return False
        self._seen_ns[slot] = max(now, time.monotonic_ns())
        return True

    def _release(self, *slots: int) -> None:
        for slot in slots:
            if slot >= 0:
                self._seen_ns[slot] = 0
                self._free.append(slot)

    # ------------------------------------------------------------ ops
    def _resolve(self, op: DeviceOp, now: int) -> bool:
        """Advance one op; whether it is finished with."""
        board = self._board
        if op.start is None and self._seen(op.pre, now):
            op.start = self._map(op.pre)
            for i in op.indices:  # provisional until an anchor maps it: it was reached
                if op.start is not None:
                    board.set_device(i, op.start[2], op.start[0], 0, op.start[1])
                else:
                    board.set_device(i, TIME_POLL, self._seen_ns[op.pre], 0, 0)
        resolve = self._resolve_blocking if op.post >= 0 else self._resolve_async
        finished = resolve(op, now)
        if not finished and op.exited and now - op.since_ns > GIVE_UP_NS:
            book = self._book(op.step)  # no anchor mapped it: its step goes unmeasured
            book.broken, book.pending = True, book.pending - 1
            finished = True
        if finished:
            self._release(op.pre, op.post)
        return finished

    def _resolve_blocking(self, op: DeviceOp, now: int) -> bool:
        if not self._seen(op.post, now):
            return False
        if op.end is None:
            op.end = self._map(op.post)
            poll = (self._seen_ns[op.post], 0, TIME_POLL)
            t, err, src = op.end or poll
            for i in op.indices:
                self._board.set_device(i, src, 0, t, err)
        if not op.exited:
            op.exited = True
            self._exit_many(op.indices, STATE_DONE)
        if op.start is None or op.end is None:
            return False  # mapped once an anchor comes
        book = self._book(op.step)
        book.blocked += max(0, op.end[0] - op.start[0])
        book.pending -= 1
        return True

    def _resolve_async(self, op: DeviceOp, now: int) -> bool:
        for index, work in op.works:
            if index in op.done_ns:
                continue
            try:  # (None: a blocking op with no event after it, done when it returned)
                if work is not None and not work.is_completed():
                    continue
                ok = work is None or _succeeded(work)
            except Exception as exc:  # noqa: BLE001
                report_error("device.work", exc)
                ok = False
            op.done_ns[index] = (now, _duration_ms(work), ok)
            self._board.set_device(index, TIME_POLL, 0, now, 0)
            self._exit_many((index,), STATE_DONE if ok else STATE_ERROR)
        op.exited = len(op.done_ns) == len(op.works)
        if not op.exited or op.start is None:
            return False
        for index, (_, dur_ms, _) in op.done_ns.items():
            if dur_ms is not None:
                t, err, _ = op.start
                self._board.set_device(index, TIME_WORK, 0, t + round(dur_ms * 1e6), err)
        return True

    # ------------------------------------------------------------ steps
    def _resolve_wait(self, w: tuple[int, int, int], now: int) -> bool:
        step, w0, w1 = w
        if not (self._seen(w0, now) and self._seen(w1, now)):
            return False
        a, b = self._map(w0), self._map(w1)
        if a is None or b is None:
            return False
        book = self._book(step)
        book.blocked += max(0, b[0] - a[0])
        book.pending -= 1
        self._release(w0, w1)
        return True

    def _resolve_mark(self, m: tuple[int, int], now: int) -> bool:
        step, slot = m
        if not self._seen(slot, now):
            return False
        t = self._map(slot)
        if t is None:
            return False
        book = self._book(step)
        book.start, book.err = t[0], t[1]
        self._release(slot)
        return True

    def _finish_steps(self) -> None:
        for step, book in list(self._steps.items()):
            after = self._steps.get(book.next_step) if book.next_step is not None else None
            if after is None or after.start is None or book.start is None or book.pending:
                continue
            del self._steps[step]
            if not book.broken:
                span, err = after.start - book.start, book.err + after.err
                self._done.append(DeviceStep(step, book.start, span, min(book.blocked, span), err))


def _duration_ms(work: Any) -> float | None:
    """The work's own device duration (NCCL with timing on), or None where it has none."""
    try:
        return float(work._get_duration())
    except Exception:  # noqa: BLE001 - no timing on this group or backend: a host time then
        return None


def _succeeded(work: Any) -> bool:
    try:
        return bool(work.is_success())
    except Exception:  # noqa: BLE001 - not every work type answers; completion is enough
        return True
