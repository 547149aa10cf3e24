"""The summary a rank publishes every agent tick, and its compact binary encoding.

A value type: plain dataclasses and named tuples (the per-op records: the diagnoser decodes
hundreds of thousands of them per round at scale, and tuples are the cheapest to build),
no torch. Every time in it is on the diagnoser's
monotonic clock (the agent applies its clock offset), so the diagnoser compares ranks
directly. Steady state is a few hundred bytes per rank; a per-node aggregator could merge
the summaries of its ranks into one value without the diagnoser's analysis changing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

__all__ = [
    "SAMPLE_DTYPE",
    "ArrivalSample",
    "GroupProgress",
    "InFlightOp",
    "RankSummary",
    "StepStat",
    "arrival_samples",
    "decode_summary",
    "encode_summary",
    "encoded_samples",
]

SUMMARY_VERSION = 1
FLAG_EXITED = 1  # the rank left through the plugin's exit path
FLAG_ERRORED = 2  # ...after a collective raised


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
    compute_us: int  # step time minus time blocked in collectives


class ArrivalSample(NamedTuple):
    """When this rank entered and left one collective, for the arrival-skew join."""

    slot: int
    seq: int
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

    @property
    def exited(self) -> bool:
        return bool(self.flags & FLAG_EXITED)


_HEAD = struct.Struct("<BBiiqqqiHIHHHHHHI")
_GROUP = struct.Struct("<HQQIIQI")
_FLIGHT = struct.Struct("<HBBiQQqB")
# Step starts and sample times go relative to the summary's time, in microseconds, and a
# sample's seq as its distance below the group's completed seq: that keeps a steady-state
# summary under 1 KB.
_STEP = struct.Struct("<iiII")
_SAMPLE = struct.Struct("<HIiII")
SAMPLE_DTYPE = np.dtype(
    [("slot", "<u2"), ("back", "<u4"), ("rel_us", "<i4"), ("dur_us", "<u4"), ("bytes", "<u4")]
)  # _SAMPLE's rows, packed
assert SAMPLE_DTYPE.itemsize == _SAMPLE.size


def _clip32(v: int) -> int:
    return max(0, min(int(v), 0xFFFFFFFF))


def _rel_us(t_ns: int, base_ns: int) -> int:
    return max(-(2**31), min(2**31 - 1, (t_ns - base_ns) // 1000))


def encode_summary(s: RankSummary) -> bytes:
    host = s.host.encode()[:255]
    stack = [f.encode()[:400] for f in s.stack[:32]]
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
            t.step, _rel_us(t.start_ns, s.time_ns), _clip32(t.step_us), _clip32(t.compute_us)
        )
        for t in s.steps
    ]
    parts.append(encoded_samples(s))
    for f in stack:
        parts += [struct.pack("<H", len(f)), f]
    parts.append(s.channels)
    return b"".join(parts)


def decode_summary(data: bytes) -> RankSummary:
    """Inverse of :func:`encode_summary`. Raises ValueError on a foreign or corrupt value."""
    if len(data) < _HEAD.size or data[0] != SUMMARY_VERSION:
        raise ValueError("not a ccld summary of this version")
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
    off = _HEAD.size
    host = data[off : off + nhost].decode(errors="replace")
    off += nhost

    def table(st: struct.Struct, n: int) -> list[tuple]:
        nonlocal off
        rows = list(st.iter_unpack(data[off : off + st.size * n])) if n else []
        off += st.size * n
        return rows

    groups = [GroupProgress(*r) for r in table(_GROUP, ng)]
    flights = [InFlightOp(*r) for r in table(_FLIGHT, nf)]
    steps = [
        StepStat(step, time_ns + rel * 1000, st_us, c_us)
        for step, rel, st_us, c_us in table(_STEP, nst)
    ]
    sample_rows = bytes(data[off : off + _SAMPLE.size * nsa])
    off += _SAMPLE.size * nsa
    stack = []
    for _ in range(nstack):
        (n,) = struct.unpack_from("<H", data, off)
        stack.append(data[off + 2 : off + 2 + n].decode(errors="replace"))
        off += 2 + n
    channels = bytes(data[off : off + nchan])
    if off + nchan != len(data):
        raise ValueError("corrupt ccld summary (length mismatch)")
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
        channels=channels,
        sample_rows=sample_rows,
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
