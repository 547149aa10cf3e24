"""Functional collectives on the board: the ops of ``torch.distributed._functional_collectives``
(DTensor's redistributions, tensor parallelism, async TP) call ``torch.ops._c10d_functional``
ops, which reach the process group from C++, past the wrapped ``torch.distributed``
functions. Without them a rank waiting in a tensor-parallel all-reduce looked as if it
were in no collective at all.

The ops are wrapped where Python code looks them up, on the ``torch.ops._c10d_functional``
namespace. An op is on the board from its call until the first ``wait_tensor`` on its
output (its result used), or until that output is freed unwaited: the op launches at the
call and the caller blocks only at the wait. (A graph compiled by torch.compile calls the
ops from C++: not seen; inside compilation the wrappers only call through.)
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.distributed_c10d as c10d

from ccld_plugin.errors import report_error
from ccld_plugin.wire.codes import FLAG_ASYNC, FLAG_CUDA, OP_CODES, STATE_DONE, STATE_ERROR

if TYPE_CHECKING:
    from ccld_plugin.tracing.tracer import Tracer

__all__ = ["FunctionalOps"]

# op -> (the board's name for it, position of its group argument)
OPS: dict[str, tuple[str, int]] = {
    "all_reduce": ("all_reduce", 2),
    "all_reduce_": ("all_reduce", 2),
    "all_gather_into_tensor": ("all_gather_into_tensor", 2),
    "all_gather_into_tensor_out": ("all_gather_into_tensor", 2),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", 3),
    "reduce_scatter_tensor_out": ("reduce_scatter_tensor", 3),
    "all_to_all_single": ("all_to_all_single", 3),
    "broadcast": ("broadcast", 2),
    "broadcast_": ("broadcast", 2),
    "all_reduce_coalesced": ("all_reduce_coalesced", 2),
    "all_gather_into_tensor_coalesced": ("all_gather_coalesced", 2),
    "reduce_scatter_tensor_coalesced": ("coalesced", 3),
}
WAIT = "wait_tensor"


class _Wrapped:
    """Stands in for an op packet on the namespace: calls go through ``call``, anything
    else (``.default``, ``.overloads()``) to the packet."""

    def __init__(self, packet: Any, call: Callable[..., Any]) -> None:
        self._packet = packet
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._packet(*args, **kwargs)
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


class FunctionalOps:
    """The wrappers of one tracer's functional ops: installed on the namespace, removed
    by ``uninstall``."""

    def __init__(self, tracer: Tracer) -> None:
        # weakly: the tracer holds this object (a cycle would keep the native board alive
        # past the interpreter's exit, which nanobind reports as a leak)
        self.tracer = weakref.proxy(tracer)
        self._namespace = torch.ops._c10d_functional
        self._originals: dict[str, Any] = {}
        # by an op's output (_key), until waited or freed: the op; and by group slot, its
        # ops in flight in the order they were called
        self._pending: dict[int, _Flight] = {}
        self._in_flight: dict[int, list[_Flight]] = {}
        # reentrant: a release of an output (its finalizer) may come from a garbage
        # collection that runs while this thread holds it
        self._lock = threading.RLock()
        self._groups: dict[str, Any] = {}  # group name -> process group

    def install(self) -> None:
        for name in (*OPS, WAIT):
            try:
                packet = getattr(self._namespace, name)
            except (AttributeError, RuntimeError):
                continue  # not in this torch release
            self._originals[name] = packet
            call = self._wait(packet) if name == WAIT else self._op(name, packet)
            setattr(self._namespace, name, _Wrapped(packet, call))

    def uninstall(self) -> None:
        for name, packet in self._originals.items():
            setattr(self._namespace, name, packet)
        self._originals.clear()

    def _process_group(self, group: Any) -> Any:
        if not isinstance(group, str):
            return group
        pg = self._groups.get(group)
        if pg is None:
            pg = self._groups[group] = c10d._resolve_process_group(group)  # type: ignore[arg-type]
        return pg

    def _op(self, name: str, packet: Any) -> Callable[..., Any]:
        code = OP_CODES[OPS[name][0]]
        group_at = OPS[name][1]
        tracer = self.tracer

        def traced(*args: Any, **kwargs: Any) -> Any:
            try:
                if tracer.before_op is not None:
                    tracer.before_op()
                e = tracer.entry(self._process_group(args[group_at]))
                if e is None:
                    return packet(*args, **kwargs)
                first = args[0]
                inputs = first if isinstance(first, (list, tuple)) else [first]
                cuda = bool(inputs) and inputs[0].is_cuda
                flags = FLAG_ASYNC | (FLAG_CUDA if cuda else 0)
                slot = e.slot
                index = tracer.board.enter(slot, code, flags, sum(t.nbytes for t in inputs))
            except Exception as exc:  # noqa: BLE001
                report_error(f"tracer.functional.{name}", exc)
                return packet(*args, **kwargs)
            try:
                out = packet(*args, **kwargs)
            except BaseException:
                tracer.exit_many((index,), STATE_ERROR)
                raise
            try:
                self._await(index, slot, list(out) if isinstance(out, (list, tuple)) else [out])
            except Exception as exc:  # noqa: BLE001
                tracer.exit_many((index,), STATE_DONE)
                report_error(f"tracer.functional.{name}", exc)
            return out

        return traced

    def _await(self, index: int, slot: int, outputs: list[Any]) -> None:
        """Keep op ``index`` in flight until each of its outputs is waited on or freed."""
        keys = [_key(t) for t in outputs]
        # (the process group holds an output until it is waited on: its release follows
        # the wait, or the end of the job)
        released = [
            weakref.ref(t, functools.partial(self._released, key))
            for t, key in zip(outputs, keys, strict=True)
        ]
        flight = _Flight(index, slot, list(keys), released)
        with self._lock:
            for key in keys:
                self._pending[key] = flight
            self._in_flight.setdefault(slot, []).append(flight)

    def _released(self, key: int, _ref: Any) -> None:
        self._finish(key, STATE_DONE)

    def _finish(self, key: int, state: int) -> None:
        """Output ``key`` was waited on (or freed). Its op ends with its last output, and
        so do the ops that the group ran before it: a group runs its collectives in the
        order they were called (a result never waited on is not held in flight forever)."""
        with self._lock:
            flight = self._pending.pop(key, None)
            if flight is None:
                return
            flight.keys.remove(key)
            if flight.keys:
                return
            flights = self._in_flight[flight.slot]
            at = flights.index(flight)
            ended, self._in_flight[flight.slot] = flights[: at + 1], flights[at + 1 :]
            for f in ended:
                for k in f.keys:
                    self._pending.pop(k, None)
        self.tracer.exit_many(tuple(f.index for f in ended[:-1]), STATE_DONE)
        self.tracer.exit_many((flight.index,), state)

    def _wait(self, packet: Any) -> Callable[..., Any]:
        tracer = self.tracer

        def traced(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            key = _key(tensor)
            if key not in self._pending:
                return packet(tensor, *args, **kwargs)
            t0 = time.monotonic_ns()
            try:
                result = packet(tensor, *args, **kwargs)
            except BaseException:
                self._finish(key, STATE_ERROR)
                raise
            finally:
                tracer.add_wait(time.monotonic_ns() - t0)
            self._finish(key, STATE_DONE)
            return result

        return traced


def _key(t: Any) -> int:
    """An op's output, as the wait finds it: DTensor waits on an alias of the output
    (another tensor object), so by its data; by object where it has none."""
    return t.data_ptr() or id(t)


class _Flight:
    """An op on the board, its group's slot, its outputs not waited on yet (by _key), and
    the weak references that tell their release."""

    __slots__ = ("index", "slot", "keys", "released")

    def __init__(self, index: int, slot: int, keys: list[int], released: list[Any]) -> None:
        self.index = index
        self.slot = slot
        self.keys = keys
        self.released = released
