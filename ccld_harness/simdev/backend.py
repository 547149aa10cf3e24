"""A c10d backend on the simulated device (``"sim"``), whose work behaves as NCCL's.

Each process group has its own collective stream (NCCL's ``ncclStreams_``). A collective
records an event on the current (compute) stream, its stream waits for it (the inputs are
ready), runs the real data movement through an inner gloo group from that stream's thread,
and records start and end events around it. The call returns at once; ``wait()`` makes
the compute stream, not the host, wait for the end; ``is_completed()`` is the end event's
``query()``; ``_get_duration()`` is the device time from start to end, as NCCL's with
timing on. The host sees results only through sync points (``SimDevice.synchronize``,
an event's ``synchronize``), as on a GPU.

:func:`register` makes ``"sim"`` a backend of torch.distributed and a device of the
plugin (``ccld_plugin.register_device``): the plugin's tracer then reads this device's
timeline through the same event interface it reads CUDA's with.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ccld_harness.simdev.device import SimDevice, SimEvent

__all__ = ["BACKEND", "SimProcessGroup", "SimWork", "close_groups", "register"]

BACKEND = "sim"
_GROUPS: list[SimProcessGroup] = []


class SimWork(dist._Work):
    """One collective's work: done when the device has run it."""

    def __init__(
        self, device: SimDevice, tensors: list[torch.Tensor], start: SimEvent, end: SimEvent
    ) -> None:
        super().__init__()
        self._device = device
        self._tensors = tensors
        self.start, self.end = start, end
        self.failed: str | None = None
        self._future: Future = Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        # orders the current stream after the collective; the host does not block
        self._device.current_stream().wait_event(self.end)
        return True

    def is_completed(self) -> bool:
        return self.end.query()

    def is_success(self) -> bool:
        return self.end.query() and self.failed is None

    def get_future(self) -> Future:
        return self._future

    def _get_duration(self) -> float:
        return self.start.elapsed_time(self.end)


class SimProcessGroup(dist.ProcessGroup):
    """A process group whose collectives run on the simulated device."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        # c10d's Python groups take (rank, size); the stubs know only the C++ constructor
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.device = SimDevice.get()
        self.stream = self.device.new_stream(f"comm{len(_GROUPS)}")
        # (the store c10d hands a group is the group's own already)
        self._gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("sim", store), rank, size, timeout)
        self._name = self._desc = ""
        _GROUPS.append(self)

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND

    # A Python group keeps its own name (functional collectives and DeviceMesh ask for it).
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def _enqueue(self, tensors: list[torch.Tensor], run: Callable[[], None]) -> SimWork:
        device, stream = self.device, self.stream
        ready = device.event()
        ready.record()  # on the current stream: the inputs are ready there
        stream.wait_event(ready)
        work = SimWork(device, tensors, device.event(), device.event())
        work.start.record(stream)

        def collective() -> None:
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - the work fails, the stream goes on
                work.failed = f"{type(exc).__name__}: {exc}"
                raise

        stream.launch(collective, 0.0, compute=False)
        work.end.record(stream)
        stream.launch(lambda: work._future.set_result(tensors), 0.0, compute=False)
        return work

    # The overrides below are the forms c10d calls a Python group with (the stubs list the
    # C++ group's overloads as well).
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:  # type: ignore[override]
        options = dist.AllreduceOptions()
        options.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM  # type: ignore[assignment]
        return self._enqueue(tensors, lambda: self._gloo.allreduce(tensors, options).wait())

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        return self._enqueue(inputs, lambda: self._gloo.allgather(outputs, inputs).wait())

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> SimWork:  # type: ignore[override]
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = opts.rootRank, opts.rootTensor
        return self._enqueue(tensors, lambda: self._gloo.broadcast(tensors, options).wait())

    def barrier(self, opts: Any = None) -> SimWork:
        return self._enqueue([], lambda: self._gloo.barrier().wait())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> SimWork:
        return self._enqueue(tensors, lambda: self._gloo.send(tensors, dst, tag).wait())

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> SimWork:
        return self._enqueue(tensors, lambda: self._gloo.recv(tensors, src, tag).wait())

    def close(self) -> None:
        """Drop the inner gloo group (the streams are stopped with the device)."""
        self._gloo = None


def close_groups() -> None:
    """Before ``destroy_process_group``: drain and stop the device, drop the inner gloo
    groups (left to the interpreter's teardown, torch aborts the process)."""
    device = SimDevice.get()
    device.synchronize()
    device.close()
    for group in _GROUPS:
        group.close()
    _GROUPS.clear()


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> SimProcessGroup:
    return SimProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Make ``"sim"`` a torch.distributed backend and a device the plugin reads."""
    import ccld_plugin

    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    device = SimDevice.get()
    ccld_plugin.register_device(BACKEND, device.event, lambda: _anchor_stream(device))


_ANCHOR: list[Any] = []


def _anchor_stream(device: SimDevice) -> Any:
    """A stream that runs nothing else: where the plugin records its clock anchor."""
    if not _ANCHOR:
        _ANCHOR.append(device.new_stream("anchor"))
    return _ANCHOR[0]
