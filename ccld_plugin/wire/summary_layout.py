"""The layout of a rank summary's value: its version, the numpy rows of its records (for the
decoders that read many values at once, ``summary_batch``), the structs made from them (for
one value at a time, ``summary``), and where its sections lie. No torch, no native module.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "FLIGHT_DTYPE",
    "FLIGHT_ROW",
    "FRAME_LEN",
    "GROUP_DTYPE",
    "GROUP_ROW",
    "HEAD_DTYPE",
    "HEAD_ROW",
    "MAX_FRAME",
    "MAX_FRAMES",
    "MAX_HOST",
    "NOT_THIS_VERSION",
    "P2P_DTYPE",
    "P2P_ROW",
    "SAMPLE_DTYPE",
    "SAMPLE_ROW",
    "STEP_DTYPE",
    "STEP_ROW",
    "STEP_ROW_OF_VERSION",
    "SUMMARY_VERSION",
    "Sections",
    "SummaryError",
    "read_frames",
    "sections",
]

# 2: a step's wait for a CPU (StepStat.cpu_wait_us). 3: point-to-point samples, after the
# channel evidence. 4: device time (summary.FLAG_DEVICE_TIME and its sources in the flags;
# then a step's last figure is the host's compute). Values of versions 1 to 3 still decode
# (a recording made before), with no wait, no point-to-point samples, host time.
SUMMARY_VERSION = 4
MAX_HOST = 255  # bytes of the host name kept
MAX_FRAMES, MAX_FRAME = 32, 400  # stack frames kept, bytes per frame
NOT_THIS_VERSION = "corrupt ccld summary: not a ccld summary of this version"


class SummaryError(ValueError):
    """A value that is not a summary of this version, or one that fails its own checks."""


# The records of a value, defined once: numpy rows for the decoders that read many values
# at once (summary_batch), and the structs made from them for one value at a time. Step
# starts and sample times go relative to the summary's time, in microseconds, and a
# sample's seq as its distance below the group's completed seq: that keeps a steady-state
# summary under 1 KB.
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
_STEP_V1_FIELDS = [("step", "<i4"), ("rel_us", "<i4"), ("step_us", "<u4"), ("compute_us", "<u4")]
# A step's last figure, ``aside_us``: on host clocks its wait for a CPU; in a summary of
# device time (summary.FLAG_DEVICE_TIME) the host's own measure of its compute (there the
# wait for a CPU is the host's, and shows in the device's compute as idle time).
STEP_DTYPE = np.dtype([*_STEP_V1_FIELDS, ("aside_us", "<u4")])
_STEP_V1_DTYPE = np.dtype(_STEP_V1_FIELDS)  # without the wait for a CPU
SAMPLE_DTYPE = np.dtype(
    [("slot", "<u2"), ("back", "<u4"), ("rel_us", "<i4"), ("dur_us", "<u4"), ("bytes", "<u4")]
)
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
)
FRAME_LEN = struct.Struct("<H")  # before each stack frame's bytes
_STRUCT_CODES = {"u1": "B", "u2": "H", "u4": "I", "u8": "Q", "i4": "i", "i8": "q"}


def _struct(dtype: np.dtype) -> struct.Struct:
    """The struct of one row of ``dtype`` (packed, little-endian)."""
    assert dtype.fields is not None
    codes = [_STRUCT_CODES[f"{t.kind}{t.itemsize}"] for t, *_ in dtype.fields.values()]
    return struct.Struct("<" + "".join(codes))


HEAD_ROW, GROUP_ROW, FLIGHT_ROW = _struct(HEAD_DTYPE), _struct(GROUP_DTYPE), _struct(FLIGHT_DTYPE)
STEP_ROW = _struct(STEP_DTYPE)
# a step record in each version a value may have
STEP_ROW_OF_VERSION = {1: _struct(_STEP_V1_DTYPE), 2: STEP_ROW, 3: STEP_ROW, 4: STEP_ROW}
SAMPLE_ROW, P2P_ROW = _struct(SAMPLE_DTYPE), _struct(P2P_DTYPE)


class Sections(NamedTuple):
    """Where a value's sections start: host name, group progress, in-flight ops, steps,
    arrival samples, stack frames. After the frames: the channel evidence
    (``n_channels`` bytes), then point-to-point samples to the end."""

    host: Any
    groups: Any
    flights: Any
    steps: Any
    samples: Any
    frames: Any


def sections(head_end: Any, counts: Sequence[Any], step_size: int = STEP_ROW.size) -> Sections:
    """The sections of values whose heads end at ``head_end``, from their heads' counts of
    host bytes, groups, in-flight ops, steps and samples: ints for one value, numpy arrays
    for many alike. ``step_size``: a step record's size in the values' version."""
    n_host, n_groups, n_flights, n_steps, n_samples = counts
    groups = head_end + n_host
    flights = groups + GROUP_ROW.size * n_groups
    steps = flights + FLIGHT_ROW.size * n_flights
    samples = steps + step_size * n_steps
    frames = samples + SAMPLE_ROW.size * n_samples
    return Sections(head_end, groups, flights, steps, samples, frames)


def read_frames(value: bytes, at: int, count: int) -> tuple[list[str], int]:
    """The ``count`` stack frames of ``value`` from ``at``, and where they end. Raises
    :class:`SummaryError` on frames that are not what the encoder writes."""
    frames = []
    try:
        for _ in range(count):
            (n,) = FRAME_LEN.unpack_from(value, at)
            if n > MAX_FRAME:
                raise SummaryError("corrupt ccld summary (a stack frame longer than encoded)")
            frames.append(value[at + 2 : at + 2 + n].decode())
            at += 2 + n
    except (struct.error, UnicodeDecodeError) as exc:
        raise SummaryError(f"corrupt ccld summary ({exc})") from None
    return frames, at
