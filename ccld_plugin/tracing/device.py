"""Devices whose collectives run asynchronously, and the timing events their timeline is
read from.

On a GPU a collective is a kernel on a stream: the call returns once it is enqueued, and
only the device knows when it ran. The tracer reads that from timing events with CUDA's
semantics (``torch.cuda.Event(enable_timing=True)``): ``record(stream=None)`` puts the
event on the calling thread's current stream (or ``stream``) and returns at once,
``query()`` says without blocking whether the stream has reached it, and
``a.elapsed_time(b)`` is the device time between two completed events, in milliseconds.
Nothing here ever synchronizes.

A :class:`DeviceKind` says how to make such events for the process groups of one backend,
and the stream the clock anchor is recorded on (one that runs nothing else). NCCL groups
use CUDA's, built in, where torch has CUDA; another device registers its own with
:func:`register_device` (the test harness's simulated device does), so that the same
tracer code reads it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceKind", "device_kind", "group_device", "register_device"]


@dataclass(frozen=True)
class DeviceKind:
    """How the device timeline of one backend's process groups is read."""

    name: str
    new_event: Callable[[], Any]  # a timing event: record(stream=None), query(), elapsed_time
    anchor_stream: Callable[[], Any]  # a stream that runs nothing else, for the clock anchor
    # Turns the group's own work timing on (before its first op), so that async work gives
    # its device duration (``work._get_duration()``); None where the backend has none.
    enable_work_timing: Callable[[Any], None] | None = None


_KINDS: dict[str, DeviceKind] = {}
_LOCK = threading.Lock()


def register_device(
    backend: str,
    new_event: Callable[[], Any],
    anchor_stream: Callable[[], Any],
    enable_work_timing: Callable[[Any], None] | None = None,
) -> None:
    """Read the device timeline of process groups whose backend is ``backend`` (the name
    ``torch.distributed.get_backend`` gives them) from events made by ``new_event``, with
    the clock anchor recorded on the stream ``anchor_stream()`` returns. Groups registered
    with the tracer afterwards are device groups: their ops' exits come from the device,
    and their times from its events. Raises ValueError for an empty name."""
    name = backend.strip().lower()
    if not name:
        raise ValueError("register_device: the backend name is empty; give the name of a backend")
    with _LOCK:
        _KINDS[name] = DeviceKind(name, new_event, anchor_stream, enable_work_timing)


def device_kind(backend: str) -> DeviceKind | None:
    """The device kind of a group whose backend is ``backend`` (for a group with several
    backends, such as ``cpu:gloo,cuda:nccl``, the device's), or None for a CPU group."""
    names = [part.rpartition(":")[2] for part in backend.lower().split(",")]
    with _LOCK:
        for name in names:
            if name in _KINDS:
                return _KINDS[name]
    return _cuda() if "nccl" in names else None


def group_device(pg: Any) -> tuple[str, DeviceKind | None]:
    """Where a process group's ops run: "cpu", "cuda" (a device: NCCL, a registered
    device) or "mixed" (several backends: the tensor's device decides), and the device's
    kind (None where its timeline cannot be read)."""
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(pg)).lower()
    except Exception:  # noqa: BLE001
        return "cpu", None
    kind = device_kind(backend)
    if kind is None and "nccl" not in backend:
        return "cpu", None
    return ("cuda" if ":" not in backend else "mixed"), kind


_CUDA: list[DeviceKind | None] = []  # made once: None where torch has no CUDA


def _cuda() -> DeviceKind | None:
    with _LOCK:
        if not _CUDA:
            _CUDA.append(_make_cuda())
        return _CUDA[0]


def _make_cuda() -> DeviceKind | None:
    """CUDA's events and a stream of their own for the anchor; None on a CPU-only torch
    (nothing of CUDA is touched there)."""
    import torch

    if not torch.cuda.is_available():
        return None
    streams: list[Any] = []

    def new_event() -> Any:
        return torch.cuda.Event(enable_timing=True)

    def anchor_stream() -> Any:
        if not streams:  # made on the poller's first anchor, on the rank's current device
            streams.append(torch.cuda.Stream())
        return streams[0]

    def enable_work_timing(pg: Any) -> None:
        backend = pg._get_backend(torch.device("cuda"))
        backend._enable_collectives_timing()

    return DeviceKind("nccl", new_event, anchor_stream, enable_work_timing)
