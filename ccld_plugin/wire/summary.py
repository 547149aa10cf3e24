"""The summary a rank publishes every agent tick, and its compact binary encoding.

A value type: plain dataclasses and named tuples (the per-op records: the diagnoser decodes
hundreds of thousands of them per round at scale, and tuples are the cheapest to build),
no torch. Every time in it is on the diagnoser's
monotonic clock (the agent applies its clock offset), so the diagnoser compares ranks
directly. Steady state is a few hundred bytes per rank; a per-node aggregator could merge
the summaries of its ranks into one value without the diagnoser's analysis changing.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ccld_plugin.wire.codes import (
    FLAG_ASYNC,
    FLAG_CUDA,
    FLAG_P2P,
    FLAG_SEND,
    OP_NAMES,
    STATE_ERROR,
    STATE_IN_FLIGHT,
)

__all__ = [
    "FLIGHT_DTYPE",
    "GROUP_DTYPE",
    "HEAD_DTYPE",
    "P2P_DTYPE",
    "SAMPLE_DTYPE",
    "STEP_DTYPE",
    "ArrivalSample",
    "GroupProgress",
    "InFlightOp",
    "P2PSample",
    "RankSummary",
    "StepStat",
    "SummaryError",
    "arrival_samples",
    "decode_summary",
    "encode_summary",
    "encoded_p2p",
    "encoded_samples",
    "p2p_rows_ok",
    "p2p_samples",
    "upgraded_summary",
]

# 2: a step's wait for a CPU (StepStat.cpu_wait_us). 3: point-to-point samples, after the
# channel evidence. Values of versions 1 and 2 still decode (a recording made before),
# with no wait and no point-to-point samples.
SUMMARY_VERSION = 3
FLAG_EXITED = 1  # the rank left through the plugin's exit path
FLAG_ERRORED = 2  # ...after a collective raised
# made from its board by its node's leader after its process died (agent.node_share)
FLAG_LAST_WORDS = 4
# ...on an uncaught exception (the summary's stack: where it was raised, then the exception)
FLAG_CRASHED = 8
KNOWN_FLAGS = FLAG_EXITED | FLAG_ERRORED | FLAG_LAST_WORDS | FLAG_CRASHED
MAX_HOST = 255  # bytes of the host name kept
MAX_FRAMES, MAX_FRAME = 32, 400  # stack frames kept, bytes per frame
_OP_FLAGS = FLAG_ASYNC | FLAG_P2P | FLAG_SEND | FLAG_CUDA
LATE_NS = 10**9  # a time in a summary may pass its own time_ns by this much (a racing step)


class SummaryError(ValueError):
    """A value that is not a summary of this version, or one that fails its own checks."""


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
    step: int
    start_ns: int
    step_us: int
    compute_us: int  # step time minus time blocked in collectives and queued for a CPU
    # outside them, the training thread's wait runnable for a CPU (the host's, not compute)
    cpu_wait_us: int = 0


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

    @property
    def exited(self) -> bool:
        return bool(self.flags & FLAG_EXITED)


_HEAD = struct.Struct("<BBiiqqqiHIHHHHHHI")
_GROUP = struct.Struct("<HQQIIQI")
_FLIGHT = struct.Struct("<HBBiQQqB")
# Step starts and sample times go relative to the summary's time, in microseconds, and a
# sample's seq as its distance below the group's completed seq: that keeps a steady-state
# summary under 1 KB.
_STEP = struct.Struct("<iiIII")
_STEP_V1 = struct.Struct("<iiII")  # without the wait for a CPU
_SAMPLE = struct.Struct("<HIiII")
_P2P = struct.Struct("<HiBIiII")
_FRAME_LEN = struct.Struct("<H")
SAMPLE_DTYPE = np.dtype(
    [("slot", "<u2"), ("back", "<u4"), ("rel_us", "<i4"), ("dur_us", "<u4"), ("bytes", "<u4")]
)  # _SAMPLE's rows, packed
P2P_DTYPE = np.dtype(
    [
        ("slot", "<u2"),
        ("peer", "<i4"),
        ("sends", "u1"),
        ("seq", "<u4"),
        ("rel_us", "<i4"),
        ("dur_us", "<u4"),
        ("bytes", "<u4"),
    ]
)  # _P2P's rows, packed
# The other records as numpy rows, for decoding many summaries at once (summary_batch).
HEAD_DTYPE = np.dtype(
    [
        ("version", "u1"),
        ("flags", "u1"),
        ("rank", "<i4"),
        ("pid", "<i4"),
        ("time_ns", "<i8"),
        ("heartbeat_ns", "<i8"),
        ("last_progress_ns", "<i8"),
        ("step", "<i4"),
        ("groups_version", "<u2"),
        ("errors", "<u4"),
        ("n_groups", "<u2"),
        ("n_flights", "<u2"),
        ("n_steps", "<u2"),
        ("n_samples", "<u2"),
        ("n_frames", "<u2"),
        ("n_host", "<u2"),
        ("n_channels", "<u4"),
    ]
)
GROUP_DTYPE = np.dtype(
    [
        ("slot", "<u2"),
        ("entered_seq", "<u8"),
        ("completed_seq", "<u8"),
        ("ops", "<u4"),
        ("blocked_us", "<u4"),
        ("bytes", "<u8"),
        ("max_dur_us", "<u4"),
    ]
)
FLIGHT_DTYPE = np.dtype(
    [
        ("slot", "<u2"),
        ("op", "u1"),
        ("flags", "u1"),
        ("peer", "<i4"),
        ("seq", "<u8"),
        ("bytes", "<u8"),
        ("enter_ns", "<i8"),
        ("state", "u1"),
    ]
)
STEP_DTYPE = np.dtype(
    [
        ("step", "<i4"),
        ("rel_us", "<i4"),
        ("step_us", "<u4"),
        ("compute_us", "<u4"),
        ("cpu_wait_us", "<u4"),
    ]
)
for _dtype, _struct in (
    (SAMPLE_DTYPE, _SAMPLE),
    (P2P_DTYPE, _P2P),
    (HEAD_DTYPE, _HEAD),
    (GROUP_DTYPE, _GROUP),
    (FLIGHT_DTYPE, _FLIGHT),
    (STEP_DTYPE, _STEP),
):
    assert _dtype.itemsize == _struct.size


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
    n_samples = len(s.samples) if s.samples else len(s.sample_rows) // _SAMPLE.size
    parts = [
        _HEAD.pack(
            SUMMARY_VERSION,
            s.flags,
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
        _GROUP.pack(
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
        _FLIGHT.pack(o.slot, o.op, o.flags, o.peer, o.seq, o.bytes, o.enter_ns, o.state)
        for o in s.in_flight
    ]
    parts += [
        _STEP.pack(
            t.step,
            _rel_us(t.start_ns, s.time_ns),
            _clip32(t.step_us),
            _clip32(t.compute_us),
            _clip32(t.cpu_wait_us),
        )
        for t in s.steps
    ]
    parts.append(encoded_samples(s))
    for f in stack:
        parts += [_FRAME_LEN.pack(len(f)), f]
    parts += [s.channels, encoded_p2p(s)]
    return b"".join(parts)


def decode_summary(data: bytes) -> RankSummary:
    """Inverse of :func:`encode_summary`. Raises :class:`SummaryError` (a ValueError) on a
    foreign or corrupt value: one that is not exactly what the encoder writes, or whose
    fields fail their ranges (codes, flags, counts, times against the summary's own)."""
    try:
        s = _decode(bytes(data))
    except (struct.error, UnicodeDecodeError) as exc:
        raise SummaryError(f"corrupt ccld summary ({exc})") from None
    problem = _problem(s)
    if problem is not None:
        raise SummaryError(f"corrupt ccld summary of rank {s.rank}: {problem}")
    return s


def upgraded_summary(data: bytes) -> bytes:
    """A summary value in this version's encoding: one of an earlier version (a recording
    made before) re-encoded, without what that version lacked; any other (a corrupt one
    included, which the decoders refuse with their reason) as it is."""
    if data[:1] not in (b"\x01", b"\x02"):
        return data
    try:
        return encode_summary(decode_summary(data))
    except SummaryError:
        return data


def _decode(data: bytes) -> RankSummary:
    if len(data) < _HEAD.size or data[0] not in (1, 2, SUMMARY_VERSION):
        raise SummaryError("not a ccld summary of this version")
    step_record = _STEP_V1 if data[0] == 1 else _STEP
    (
        _,
        flags,
        rank,
        pid,
        time_ns,
        hb,
        progress,
        step,
        gver,
        errors,
        ng,
        nf,
        nst,
        nsa,
        nstack,
        nhost,
        nchan,
    ) = _HEAD.unpack_from(data)
    if nhost > MAX_HOST or nstack > MAX_FRAMES:
        raise SummaryError("corrupt ccld summary (host or stack longer than encoded)")
    ends = list(
        itertools.accumulate(
            (
                nhost,
                _GROUP.size * ng,
                _FLIGHT.size * nf,
                step_record.size * nst,
                _SAMPLE.size * nsa,
            ),
            initial=_HEAD.size,
        )
    )
    if ends[-1] + 2 * nstack + nchan > len(data):
        raise SummaryError("corrupt ccld summary (shorter than its counts)")
    host = data[ends[0] : ends[1]].decode()
    groups = [GroupProgress(*r) for r in _GROUP.iter_unpack(data[ends[1] : ends[2]])]
    flights = [InFlightOp(*r) for r in _FLIGHT.iter_unpack(data[ends[2] : ends[3]])]
    steps = [
        StepStat(step_, time_ns + rel * 1000, *times)
        for step_, rel, *times in step_record.iter_unpack(data[ends[3] : ends[4]])
    ]
    off = ends[5]
    stack = []
    for _ in range(nstack):
        (n,) = _FRAME_LEN.unpack_from(data, off)
        if n > MAX_FRAME:
            raise SummaryError("corrupt ccld summary (a stack frame longer than encoded)")
        stack.append(data[off + 2 : off + 2 + n].decode())
        off += 2 + n
    p2p_bytes = len(data) - off - nchan
    if p2p_bytes < 0 or p2p_bytes % _P2P.size or (p2p_bytes and data[0] != SUMMARY_VERSION):
        raise SummaryError("corrupt ccld summary (length mismatch)")
    return RankSummary(
        rank=rank,
        pid=pid,
        host=host,
        time_ns=time_ns,
        heartbeat_ns=hb,
        step=step,
        last_progress_ns=progress,
        groups_version=gver,
        flags=flags,
        errors=errors,
        groups=groups,
        in_flight=flights,
        steps=steps,
        stack=stack,
        channels=data[off : off + nchan],
        sample_rows=data[ends[4] : ends[5]],
        p2p_rows=data[off + nchan :],
    )


def _problem(s: RankSummary) -> str | None:
    """What is impossible in a decoded summary (None: nothing found)."""
    late = s.time_ns + LATE_NS
    if s.rank < 0 or s.pid <= 0:
        return f"rank {s.rank}, pid {s.pid}"
    if s.flags & ~KNOWN_FLAGS or s.step < 0:
        return f"flags {s.flags:#x}, step {s.step}"
    if s.heartbeat_ns > late or s.last_progress_ns > late:
        return "a time after the summary's own"
    if len({g.slot for g in s.groups}) != len(s.groups):
        return "a group reported twice"
    if not all(_op_ok(o, late) for o in s.in_flight):
        return "an in-flight op with impossible fields"
    if not all(t.step >= 0 and t.compute_us + t.cpu_wait_us <= t.step_us for t in s.steps):
        return "a step with more compute than time"
    if not p2p_rows_ok(np.frombuffer(s.p2p_rows, P2P_DTYPE)).all():
        return "a point-to-point sample with impossible fields"
    return None


def p2p_rows_ok(rows: np.ndarray) -> np.ndarray:
    """Per P2P_DTYPE row: whether its fields are possible (a peer, a direction, a seq from
    1, an entry not after its summary's own time)."""
    return (
        (rows["peer"] >= 0)
        & (rows["sends"] <= 1)
        & (rows["seq"] >= 1)
        & (rows["rel_us"].astype(np.int64) * 1000 <= LATE_NS)
    )


def _op_ok(o: InFlightOp, late: int) -> bool:
    p2p = bool(o.flags & FLAG_P2P)
    return (
        o.op in OP_NAMES
        and o.flags & ~_OP_FLAGS == 0
        and (p2p or not o.flags & FLAG_SEND)
        and o.state in (STATE_IN_FLIGHT, STATE_ERROR)
        and (o.peer >= -1 if p2p else o.peer == -1)  # a recv from any source has none
        and o.seq >= 1
        and o.enter_ns <= late
    )


def encoded_samples(s: RankSummary) -> bytes:
    """The summary's arrival samples as encoded rows (SAMPLE_DTYPE): a decoded summary's
    own, or ``samples`` packed. A sample's seq is stored below its group's completed seq,
    its time relative to the summary's, in microseconds."""
    if not s.samples:
        return s.sample_rows
    completed = {g.slot: g.completed_seq for g in s.groups}
    return b"".join(
        _SAMPLE.pack(
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
        for slot, back, rel, d, b in _SAMPLE.iter_unpack(s.sample_rows)
    ]


def encoded_p2p(s: RankSummary) -> bytes:
    """The summary's point-to-point samples as encoded rows (P2P_DTYPE): a decoded
    summary's own, or ``p2p`` packed, times relative to the summary's, in microseconds."""
    if not s.p2p:
        return s.p2p_rows
    return b"".join(
        _P2P.pack(
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
        for slot, peer, sends, seq, rel, d, b in _P2P.iter_unpack(s.p2p_rows)
    ]
