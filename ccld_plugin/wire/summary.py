"""The summary a rank publishes every agent tick, and its compact binary encoding.

A value type: plain dataclasses and named tuples (the per-op records: the diagnoser decodes
hundreds of thousands of them per round at scale, and tuples are the cheapest to build),
no torch. Every time in it is on the diagnoser's monotonic clock (the agent applies its
clock offset), so the diagnoser compares ranks directly. Steady state is a few hundred
bytes per rank; a per-node aggregator could merge the summaries of its ranks into one
value without the diagnoser's analysis changing.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from ccld_plugin.wire.codes import (
    FLAG_ASYNC,
    FLAG_CUDA,
    FLAG_DEVICE,
    FLAG_P2P,
    FLAG_SEND,
    OP_NAMES,
    STATE_ERROR,
    STATE_IN_FLIGHT,
    TIME_EVENTS,
    TIME_HOST,
    TIME_POLL,
)
from ccld_plugin.wire.summary_layout import (
    FLIGHT_DTYPE,
    FLIGHT_ROW,
    FRAME_LEN,
    GROUP_DTYPE,
    GROUP_ROW,
    HEAD_DTYPE,
    HEAD_ROW,
    MAX_FRAME,
    MAX_FRAMES,
    MAX_HOST,
    NOT_THIS_VERSION,
    P2P_DTYPE,
    P2P_ROW,
    SAMPLE_DTYPE,
    SAMPLE_ROW,
    STEP_DTYPE,
    STEP_ROW,
    STEP_ROW_OF_VERSION,
    SUMMARY_VERSION,
    Sections,
    SummaryError,
    read_frames,
    sections,
)

__all__ = [
    "ARRIVALS_SHIFT",
    "FLAG_DEVICE_TIME",
    "FLIGHT_DTYPE",
    "FRAME_LEN",
    "GROUP_DTYPE",
    "HEAD_DTYPE",
    "NOT_THIS_VERSION",
    "OP_FLAGS",
    "P2P_DTYPE",
    "SAMPLE_DTYPE",
    "STEP_DTYPE",
    "ArrivalSample",
    "GroupProgress",
    "InFlightOp",
    "P2PSample",
    "RankSummary",
    "Sections",
    "StepStat",
    "SummaryError",
    "arrival_samples",
    "decode_summary",
    "encode_summary",
    "encoded_p2p",
    "encoded_samples",
    "p2p_rows_ok",
    "p2p_samples",
    "problems",
    "read_frames",
    "read_summary",
    "sections",
    "upgraded_summary",
    "without_channels",
]

FLAG_EXITED = 1  # the rank left through the plugin's exit path
FLAG_ERRORED = 2  # ...after a collective raised
# made from its board by its node's leader after its process died (agent.node_share)
FLAG_LAST_WORDS = 4
# ...on an uncaught exception (the summary's stack: where it was raised, then the exception)
FLAG_CRASHED = 8
# its steps are the device's (its compute from the device timeline: ``time_source``)
FLAG_DEVICE_TIME = 16
ARRIVALS_SHIFT = 5  # flags bits 5-7: where its arrival samples' times come from (TIME_*)
KNOWN_FLAGS = FLAG_EXITED | FLAG_ERRORED | FLAG_LAST_WORDS | FLAG_CRASHED
_TIME_FLAGS = FLAG_DEVICE_TIME | 7 << ARRIVALS_SHIFT
OP_FLAGS = FLAG_ASYNC | FLAG_P2P | FLAG_SEND | FLAG_CUDA | FLAG_DEVICE  # an op record's
_OP_CODES = np.array(sorted(OP_NAMES), np.int64)
LATE_NS = 10**9  # a time in a summary may pass its own time_ns by this much (a racing step)


class GroupProgress(NamedTuple):
    slot: int  # index into the rank's published group table
    entered_seq: int
    completed_seq: int
    ops: int  # completed ops in the window
    blocked_us: int  # time the rank spent inside synchronous ops of this group
    bytes: int
    max_dur_us: int


class InFlightOp(NamedTuple):
    slot: int
    op: int
    flags: int
    peer: int
    seq: int
    bytes: int
    enter_ns: int
    state: int = 1  # in flight, or error (the op that raised)


class StepStat(NamedTuple):
    """One step of a rank, on the clock its ``source`` names: host clocks (a CPU job), or
    the device timeline (its step marks and ops on the device; the step's start mapped to
    the host's clock), where the host only launches and waits at sync points."""

    step: int
    start_ns: int
    step_us: int
    compute_us: int  # step time minus time blocked in collectives and queued for a CPU
    # outside them, the training thread's wait runnable for a CPU (the host's, not compute)
    cpu_wait_us: int = 0
    # where the summary's time_source is the device's: the host's own measure of the
    # step's compute, beside the device's (0 on host clocks: compute_us is the host's)
    host_compute_us: int = 0


class ArrivalSample(NamedTuple):
    """When this rank entered and left one collective, for the arrival-skew join."""

    slot: int
    seq: int
    enter_ns: int
    dur_us: int
    bytes: int


class P2PSample(NamedTuple):
    """When this rank entered and left one send to, or receive from, ``peer`` (a global
    rank): the point-to-point join pairs the two ends of each message."""

    slot: int
    peer: int
    sends: bool
    seq: int  # the rank's count of its sends to (receives from) the peer in the group
    enter_ns: int
    dur_us: int
    bytes: int


@dataclass
class RankSummary:
    rank: int
    pid: int
    host: str
    time_ns: int  # when it was made
    heartbeat_ns: int
    step: int
    last_progress_ns: int  # last op exit or step start
    groups_version: int
    flags: int = 0
    errors: int = 0
    groups: list[GroupProgress] = field(default_factory=list)
    in_flight: list[InFlightOp] = field(default_factory=list)
    steps: list[StepStat] = field(default_factory=list)
    samples: list[ArrivalSample] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)
    channels: bytes = b""  # channel evidence (per-peer progress), encoded by its source
    # A decoded summary keeps its arrival samples encoded here (``samples`` stays empty):
    # the diagnoser joins the samples of all ranks at once (diagnose.arrivals), tens per
    # rank, and objects for each would cost more than the rest of the round.
    # ``arrival_samples`` decodes them.
    sample_rows: bytes = b""
    # Point-to-point samples, the same way (``p2p_samples`` decodes them).
    p2p: list[P2PSample] = field(default_factory=list)
    p2p_rows: bytes = b""
    # Where its times come from: its steps' compute (low nibble: TIME_HOST or, with a
    # device timeline, TIME_EVENTS) and its arrival samples (high nibble), wire.codes TIME_*
    time_source: int = TIME_HOST

    @property
    def exited(self) -> bool:
        return bool(self.flags & FLAG_EXITED)


def _clip32(v: int) -> int:
    return max(0, min(int(v), 0xFFFFFFFF))


def _rel_us(t_ns: int, base_ns: int) -> int:
    return max(-(2**31), min(2**31 - 1, (t_ns - base_ns) // 1000))


def _utf8(text: str, limit: int) -> bytes:
    """``text`` in UTF-8, cut to ``limit`` bytes at a character boundary."""
    return text.encode()[:limit].decode(errors="ignore").encode()


def encode_summary(s: RankSummary) -> bytes:
    host = _utf8(s.host, MAX_HOST)
    stack = [_utf8(f, MAX_FRAME) for f in s.stack[:MAX_FRAMES]]
    n_samples = len(s.samples) if s.samples else len(s.sample_rows) // SAMPLE_ROW.size
    device = bool(s.time_source & 0xF)
    parts = [
        HEAD_ROW.pack(
            SUMMARY_VERSION,
            _sent_flags(s),
            s.rank,
            s.pid,
            s.time_ns,
            s.heartbeat_ns,
            s.last_progress_ns,
            s.step,
            s.groups_version,
            _clip32(s.errors),
            len(s.groups),
            len(s.in_flight),
            len(s.steps),
            n_samples,
            len(stack),
            len(host),
            len(s.channels),
        ),
        host,
    ]
    parts += [
        GROUP_ROW.pack(
            g.slot,
            g.entered_seq,
            g.completed_seq,
            _clip32(g.ops),
            _clip32(g.blocked_us),
            g.bytes,
            _clip32(g.max_dur_us),
        )
        for g in s.groups
    ]
    parts += [
        FLIGHT_ROW.pack(o.slot, o.op, o.flags, o.peer, o.seq, o.bytes, o.enter_ns, o.state)
        for o in s.in_flight
    ]
    parts += [
        STEP_ROW.pack(
            t.step,
            _rel_us(t.start_ns, s.time_ns),
            _clip32(t.step_us),
            _clip32(t.compute_us),
            _clip32(t.host_compute_us if device else t.cpu_wait_us),
        )
        for t in s.steps
    ]
    parts.append(encoded_samples(s))
    for f in stack:
        parts += [FRAME_LEN.pack(len(f)), f]
    parts += [s.channels, encoded_p2p(s)]
    return b"".join(parts)


def decode_summary(data: bytes) -> RankSummary:
    """Inverse of :func:`encode_summary`. Raises :class:`SummaryError` (a ValueError) on a
    foreign or corrupt value: one that is not exactly what the encoder writes, or whose
    fields fail their ranges (:func:`problems`: codes, flags, counts, times against the
    summary's own)."""
    try:
        s = read_summary(bytes(data))
    except (struct.error, UnicodeDecodeError) as exc:
        raise SummaryError(f"corrupt ccld summary ({exc})") from None
    problem = problems(*_records_of(s)).get(0)
    if problem is not None:
        raise SummaryError(f"corrupt ccld summary of rank {s.rank}: {problem}")
    return s


def upgraded_summary(data: bytes) -> bytes:
    """A summary value in this version's encoding: one of an earlier version (a recording
    made before) re-encoded, without what that version lacked; any other (a corrupt one
    included, which the decoders refuse with their reason) as it is."""
    if data[:1] not in (b"\x01", b"\x02", b"\x03"):
        return data
    try:
        return encode_summary(decode_summary(data))
    except SummaryError:
        return data


def without_channels(value: bytes) -> bytes:
    """A summary value with its channel evidence left out, the rest as it was."""
    return encode_summary(replace(read_summary(value), channels=b""))


def read_summary(data: bytes) -> RankSummary:
    """The summary in ``data``, read as it lies, its fields unchecked: a value that passed
    :func:`decode_summary` or ``SummaryTable.decode``, or one on its way through them.
    Raises :class:`SummaryError`, struct.error or UnicodeDecodeError where the value's
    shape is not the encoder's."""
    if len(data) < HEAD_ROW.size or data[0] not in STEP_ROW_OF_VERSION:
        raise SummaryError(NOT_THIS_VERSION)
    step_record = STEP_ROW_OF_VERSION[data[0]]
    head = HEAD_ROW.unpack_from(data)
    (_, flags, rank, pid, time_ns, hb, progress, step, gver, errors, *counts) = head
    ng, nf, nst, nsa, nframes, nhost, nchan = counts
    if nhost > MAX_HOST or nframes > MAX_FRAMES:
        raise SummaryError("corrupt ccld summary (host or stack longer than encoded)")
    at = sections(HEAD_ROW.size, (nhost, ng, nf, nst, nsa), step_record.size)
    if at.frames + 2 * nframes + nchan > len(data):
        raise SummaryError("corrupt ccld summary (shorter than its counts)")
    device = bool(flags & FLAG_DEVICE_TIME)
    steps = [
        _step(step_, time_ns + rel * 1000, times, device)
        for step_, rel, *times in step_record.iter_unpack(data[at.steps : at.samples])
    ]
    stack, off = read_frames(data, at.frames, nframes)
    p2p_bytes = len(data) - off - nchan
    if p2p_bytes < 0 or p2p_bytes % P2P_ROW.size or (p2p_bytes and data[0] < 3):
        raise SummaryError("corrupt ccld summary (length mismatch)")
    return RankSummary(
        rank=rank,
        pid=pid,
        host=data[at.host : at.groups].decode(),
        time_ns=time_ns,
        heartbeat_ns=hb,
        step=step,
        last_progress_ns=progress,
        groups_version=gver,
        flags=flags & ~_TIME_FLAGS,
        errors=errors,
        groups=[GroupProgress(*r) for r in GROUP_ROW.iter_unpack(data[at.groups : at.flights])],
        in_flight=[InFlightOp(*r) for r in FLIGHT_ROW.iter_unpack(data[at.flights : at.steps])],
        steps=steps,
        stack=stack,
        channels=data[off : off + nchan],
        sample_rows=data[at.samples : at.frames],
        p2p_rows=data[off + nchan :],
        time_source=(TIME_EVENTS if device else TIME_HOST) | (flags >> ARRIVALS_SHIFT) << 4,
    )


_HEAD_FIELDS = ("rank", "pid", "flags", "step", "heartbeat_ns", "last_progress_ns")


def _sent_flags(s: RankSummary) -> int:
    """The summary's flags as sent: with where its times come from."""
    device = FLAG_DEVICE_TIME if s.time_source & 0xF else 0
    return s.flags | device | (s.time_source >> 4) << ARRIVALS_SHIFT


def _step(step: int, start_ns: int, times: list[int], device: bool) -> StepStat:
    """A step record of any version (its times after its start; ``device``: in a summary
    of device time, its last figure is the host's compute)."""
    step_us, compute_us, aside_us = [*times, 0][:3]
    if device:
        return StepStat(step, start_ns, step_us, compute_us, 0, aside_us)
    return StepStat(step, start_ns, step_us, compute_us, aside_us)


# what problems() reads of a summary object's head and steps
_HEAD_RULED = np.dtype([(f, "<i8") for f in (*_HEAD_FIELDS, "time_ns")])
_STEP_RULED = np.dtype([(f, "<i8") for f in ("step", "step_us", "compute_us", "cpu_wait_us")])
Records = tuple[np.ndarray, np.ndarray]  # a summary's records of one kind, and their rows


def _records_of(s: RankSummary) -> tuple[np.ndarray, Records, Records, Records, Records]:
    """One summary object's fields as :func:`problems` reads them: a row of one table."""
    head = np.array([tuple(getattr(s, f) for f in _HEAD_RULED.names or ())], _HEAD_RULED)
    head["flags"] = _sent_flags(s)
    flights = np.array([tuple(o) for o in s.in_flight], FLIGHT_DTYPE)
    steps = np.array(
        [(t.step, t.step_us, t.compute_us, t.cpu_wait_us) for t in s.steps], _STEP_RULED
    )
    p2p = np.frombuffer(encoded_p2p(s), P2P_DTYPE)
    slots = np.array([g.slot for g in s.groups], np.int64)
    return (
        head,
        (np.zeros(len(slots), np.int64), slots),
        (flights, np.zeros(len(flights), np.int64)),
        (steps, np.zeros(len(steps), np.int64)),
        (p2p, np.zeros(len(p2p), np.int64)),
    )


def problems(
    heads: np.ndarray, groups: Records, flights: Records, steps: Records, p2p: Records
) -> dict[int, str]:
    """The checks of both decoders: by summary (its index in ``heads``), the first thing
    found impossible in it. ``heads``: a row per summary with its rank, pid, flags, step
    and times; then the rows of its records, each with the index of its summary: ``groups``
    as (rows, slots), ``flights``, ``steps`` and ``p2p`` as (records, rows), with the
    fields of FLIGHT_DTYPE, STEP_DTYPE (its times absolute or not) and P2P_DTYPE."""
    late = heads["time_ns"] + LATE_NS
    found: dict[int, str] = {}

    def flag(at: np.ndarray, why: Callable[[int], str]) -> None:
        """Say ``why`` of the summaries ``at`` (indices, some perhaps repeated)."""
        for i in np.unique(at).tolist():
            found.setdefault(i, why(i))

    flag(
        np.flatnonzero((heads["rank"] < 0) | (heads["pid"] <= 0)),
        lambda i: f"rank {heads['rank'][i]}, pid {heads['pid'][i]}",
    )
    flag(
        np.flatnonzero(
            ((heads["flags"] & ~(KNOWN_FLAGS | _TIME_FLAGS)) != 0)
            | (heads["flags"] >> ARRIVALS_SHIFT > TIME_POLL)
            | (heads["step"] < 0)
        ),
        lambda i: f"flags {heads['flags'][i]:#x}, step {heads['step'][i]}",
    )
    flag(
        np.flatnonzero((heads["heartbeat_ns"] > late) | (heads["last_progress_ns"] > late)),
        lambda i: "a time after the summary's own",
    )
    rows, slots = groups
    ascending = (rows[1:] > rows[:-1]) | ((rows[1:] == rows[:-1]) & (slots[1:] > slots[:-1]))
    if not ascending.all():  # agents write slots in order: sorted, no slot is twice
        order = np.lexsort((slots, rows))
        rows, slots = rows[order], slots[order]
        twice = (rows[1:] == rows[:-1]) & (slots[1:] == slots[:-1])
        flag(rows[1:][twice], lambda i: "a group reported twice")
    f, rows = flights
    op_flags = f["flags"].astype(np.int64)
    p2p_op = (op_flags & FLAG_P2P) != 0
    op_ok = (
        np.isin(f["op"], _OP_CODES)
        & ((op_flags & ~OP_FLAGS) == 0)
        & (p2p_op | ((op_flags & FLAG_SEND) == 0))
        & ((f["state"] == STATE_IN_FLIGHT) | (f["state"] == STATE_ERROR))
        & np.where(p2p_op, f["peer"] >= -1, f["peer"] == -1)  # a recv from any source has none
        & (f["seq"] >= 1)
        & (f["enter_ns"] <= late[rows])
    )
    flag(rows[~op_ok], lambda i: "an in-flight op with impossible fields")
    st, rows = steps
    step_ok = (st["step"] >= 0) & (
        st["compute_us"].astype(np.int64) + st["cpu_wait_us"] <= st["step_us"]
    )
    flag(rows[~step_ok], lambda i: "a step with more compute than time")
    records, rows = p2p
    flag(rows[~p2p_rows_ok(records)], lambda i: "a point-to-point sample with impossible fields")
    return found


def p2p_rows_ok(rows: np.ndarray) -> np.ndarray:
    """Per P2P_DTYPE row: whether its fields are possible (a peer, a direction, a seq from
    1, an entry not after its summary's own time)."""
    return (
        (rows["peer"] >= 0)
        & (rows["sends"] <= 1)
        & (rows["seq"] >= 1)
        & (rows["rel_us"].astype(np.int64) * 1000 <= LATE_NS)
    )


def encoded_samples(s: RankSummary) -> bytes:
    """The summary's arrival samples as encoded rows (SAMPLE_DTYPE): a decoded summary's
    own, or ``samples`` packed. A sample's seq is stored below its group's completed seq,
    its time relative to the summary's, in microseconds."""
    if not s.samples:
        return s.sample_rows
    completed = {g.slot: g.completed_seq for g in s.groups}
    return b"".join(
        SAMPLE_ROW.pack(
            a.slot,
            _clip32(completed.get(a.slot, a.seq) - a.seq),
            _rel_us(a.enter_ns, s.time_ns),
            _clip32(a.dur_us),
            _clip32(a.bytes),
        )
        for a in s.samples
    )


def arrival_samples(s: RankSummary) -> list[ArrivalSample]:
    """The summary's arrival samples as objects (decoded from ``sample_rows`` if need be)."""
    if s.samples or not s.sample_rows:
        return list(s.samples)
    completed = {g.slot: g.completed_seq for g in s.groups}
    return [
        ArrivalSample(slot, completed.get(slot, 0) - back, s.time_ns + rel * 1000, d, b)
        for slot, back, rel, d, b in SAMPLE_ROW.iter_unpack(s.sample_rows)
    ]


def encoded_p2p(s: RankSummary) -> bytes:
    """The summary's point-to-point samples as encoded rows (P2P_DTYPE): a decoded
    summary's own, or ``p2p`` packed, times relative to the summary's, in microseconds."""
    if not s.p2p:
        return s.p2p_rows
    return b"".join(
        P2P_ROW.pack(
            p.slot,
            p.peer,
            int(p.sends),
            _clip32(p.seq),
            _rel_us(p.enter_ns, s.time_ns),
            _clip32(p.dur_us),
            _clip32(p.bytes),
        )
        for p in s.p2p
    )


def p2p_samples(s: RankSummary) -> list[P2PSample]:
    """The summary's point-to-point samples as objects (decoded from ``p2p_rows``)."""
    if s.p2p or not s.p2p_rows:
        return list(s.p2p)
    return [
        P2PSample(slot, peer, bool(sends), seq, s.time_ns + rel * 1000, d, b)
        for slot, peer, sends, seq, rel, d, b in P2P_ROW.iter_unpack(s.p2p_rows)
    ]
