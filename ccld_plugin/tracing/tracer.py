"""Collective tracer: wraps every collective entry point of ``torch.distributed``.

Each call becomes one op record on the board, tagged with a trace id ``(group_id, seq)``:
``seq`` counts the collectives this rank issued on the group (P2P ops count per peer and
direction), so the same id names the same collective on every member. The hot path is one
native call at enter and one at exit.

Installing late is fine: after wrapping, every reference to an original that a loaded
module (or a known holder object such as DeepSpeed's ``TorchBackend``) captured at import
is rebound to its wrapper, and ``uninstall`` rebinds everything back.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import ccld_plugin._native as _native
from ccld_plugin.errors import report_error
from ccld_plugin.topology import GroupInfo, Topology, group_id_of, more_specific, role_index
from ccld_plugin.tracing.cpu_wait import ThreadCpuWait
from ccld_plugin.tracing.device import DeviceKind, group_device
from ccld_plugin.tracing.functional_ops import FunctionalOps
from ccld_plugin.tracing.rebind import rebind
from ccld_plugin.tracing.timeline import POLL_NS, DeviceOp, DeviceTimeline
from ccld_plugin.tracing.work import (
    CompletionPoller,
    ThreadState,
    TracedWork,
    book_cpu_wait,
    cpu_wait_now,
)
from ccld_plugin.wire.codes import (
    FLAG_ASYNC,
    FLAG_CUDA,
    FLAG_DEVICE,
    FLAG_P2P,
    FLAG_SEND,
    OP_CODES,
    STATE_DONE,
    STATE_ERROR,
)

__all__ = ["GroupEntry", "Tracer"]

NO_RANK = -1
# A thread that queued for a CPU more than this share of its last step reads its wait
# around each blocking CPU op (the wake-up after a recv on a crowded host), so that the
# agent does not take that wait out of compute twice: it is already the op's time.
WATCH_QUEUED_SHARE = 0.01


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any = None) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def _nbytes(t: Any) -> int:
    return t.nbytes


# name -> (group position, async_op position or None, position and name of the tensor
# argument whose size is the op's size (None: no tensor), whether that argument is a list).
# Bytes are the size of the op's largest buffer, the figure bandwidth is computed from.
_COLLECTIVES: dict[str, tuple[int, int | None, int | None, str, bool]] = {
    "all_reduce": (2, 3, 0, "tensor", False),
    "all_gather": (2, 3, 0, "tensor_list", True),
    "all_gather_into_tensor": (2, 3, 0, "output_tensor", False),
    "all_gather_single": (2, 3, 0, "output_tensor", False),
    "_all_gather_base": (2, 3, 0, "output_tensor", False),
    "reduce_scatter": (3, 4, 1, "input_list", True),
    "reduce_scatter_tensor": (3, 4, 1, "input", False),
    "reduce_scatter_single": (3, 4, 1, "input", False),
    "_reduce_scatter_base": (3, 4, 1, "input", False),
    "broadcast": (2, 3, 0, "tensor", False),
    "reduce": (3, 4, 0, "tensor", False),
    "all_to_all": (2, 3, 1, "input_tensor_list", True),
    "all_to_all_single": (4, 5, 1, "input", False),
    "barrier": (0, 1, None, "", False),
    "monitored_barrier": (0, None, None, "", False),
    "gather": (3, 4, 0, "tensor", False),
    "scatter": (3, 4, 0, "tensor", False),
    "all_reduce_coalesced": (2, 3, 0, "tensors", True),
    "all_gather_coalesced": (2, 3, 1, "input_tensor_list", True),
}


def _op_bytes(args: tuple, kwargs: dict, pos: int | None, name: str, is_list: bool) -> int:
    if pos is None:
        return 0
    t = args[pos] if len(args) > pos else kwargs[name]
    if is_list:
        return sum(x.nbytes for x in t) if t else 0
    return t.nbytes


# name -> (sends?, always async?, peer kwarg, group-local peer kwarg)
_P2P: dict[str, tuple[bool, bool, str, str]] = {
    "send": (True, False, "dst", "group_dst"),
    "recv": (False, False, "src", "group_src"),
    "isend": (True, True, "dst", "group_dst"),
    "irecv": (False, True, "src", "group_src"),
}
WRAPPED_NAMES = (*_COLLECTIVES, *_P2P, "batch_isend_irecv", "_coalescing_manager")


@dataclass(slots=True)
class GroupEntry:
    """What the tracer knows about one process group on this rank."""

    slot: int
    info: GroupInfo
    cuda: bool  # a device group (NCCL, a registered device): exits come from the device
    mixed: bool  # a group with several backends: the tensor's device decides
    timeline: DeviceTimeline | None = None  # where its device ops are timed, if they are


class Tracer:
    """Wraps torch.distributed for one board. At most one is installed at a time."""

    def __init__(
        self,
        board: Any,
        rank: int,
        poll_interval_s: float = 0.005,
        device_time: bool = True,
        work_timing: bool = True,
    ) -> None:
        self.board = board
        self.rank = rank
        self.topology = Topology()
        self._entries: dict[Any, GroupEntry] = {}
        self._p2p_seq: dict[tuple[int, int, bool], int] = {}
        # Ops that raised (or whose work failed): a rank that saw one keeps its board at
        # exit, however it leaves (sys.exit after catching it is no clean end).
        self.failed_ops = 0
        self._local = ThreadState()
        self._poller = CompletionPoller(poll_interval_s)
        self._functional = FunctionalOps(self)  # DTensor's ops, which reach C++ directly
        self._originals: dict[str, Any] = {}
        self._wrappers: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.current_step = -1  # set by mark_step; async wait time is booked to it
        # Called before every traced op when set: fault injection (compute-slow) uses it
        # to stretch the compute that precedes each communication.
        self.before_op: Callable[[], None] | None = None
        self._wait_ns: dict[int, int] = {}
        # The device timeline (made with the first device group, when device_time is on),
        # and whether device groups' own work timing is turned on for it.
        self.timeline: DeviceTimeline | None = None
        self._device_time, self._work_timing = device_time, work_timing

    # ----------------------------------------------------------------- groups
    def register_group(self, group: Any, role: str) -> GroupEntry | None:
        """Register ``group`` under ``role`` (refining an automatic registration)."""
        with self._lock:
            return self._register(group, role)

    def _register(self, group: Any, role: str) -> GroupEntry | None:
        pg = group if group is not None else c10d._get_default_group()
        if pg is c10d.GroupMember.NON_GROUP_MEMBER:
            return None
        entry = self._entries.get(pg)
        if entry is not None:
            new_role = more_specific(entry.info.role, role)
            if new_role != entry.info.role:
                entry.info = self.topology.add(
                    GroupInfo(entry.info.group_id, new_role, entry.info.ranks)
                )
                self.board.set_group_role(entry.slot, role_index(entry.info.role))
            return entry
        ranks = tuple(dist.get_process_group_ranks(pg))
        if self.rank not in ranks:
            return None
        gid = group_id_of(ranks)
        info = self.topology.add(GroupInfo(gid, role, ranks))
        slot = self.board.register_group(
            gid, role_index(info.role), list(ranks), ranks.index(self.rank)
        )
        if slot < 0:
            raise RuntimeError("board group table is full; raise board.max_groups")
        # The same ranks may already be on the board under another role: keep the best.
        self.board.set_group_role(slot, role_index(info.role))
        device, kind = group_device(pg)
        entry = GroupEntry(slot, info, device == "cuda", device == "mixed")
        if kind is not None and self._device_time:
            entry.timeline = self._timeline_for(pg, kind)
        self._entries[pg] = entry
        if group is None:
            self._entries[None] = entry
        return entry

    def entry(self, group: Any) -> GroupEntry | None:
        e = self._entries.get(group)
        if e is None:
            with self._lock:
                e = self._register(group, "world" if group is None else "other")
        return e

    def groups(self) -> list[GroupInfo]:
        return list(self.topology.groups.values())

    def _timeline_for(self, pg: Any, kind: DeviceKind) -> DeviceTimeline | None:
        """The timeline of a device group's ops (one per rank, of the first device kind;
        a group of another kind goes untimed), with the group's work timing turned on."""
        if self.timeline is None:
            self.timeline = DeviceTimeline(kind, self.board, self.exit_many)
            self._poller.add(self.timeline.poll, POLL_NS / 1e9)
        if self.timeline.kind is not kind:
            return None
        if self._work_timing and kind.enable_work_timing is not None:
            try:  # before the group's first op: works created after it carry the timing
                kind.enable_work_timing(pg)
            except Exception as exc:  # noqa: BLE001 - async ends then come from the poller
                report_error("tracer.work_timing", exc)
        return self.timeline

    # ----------------------------------------------------------------- steps
    def add_wait(self, ns: int) -> None:
        """Time the training loop spent blocked in ``wait()`` on async work."""
        step = self.current_step
        self._wait_ns[step] = self._wait_ns.get(step, 0) + ns
        try:
            self.board.add_blocked(ns)
        except Exception as exc:  # noqa: BLE001
            report_error("tracer.wait", exc)

    def mark_step(self, step: int) -> int:
        """The calling (training) thread starts ``step``: its waits in ``wait()`` are booked
        to it from now on. Returns ``cpu_wait_outside_ns()``. A CPU op reads the wait
        around it (~5 us) only while the thread's last step queued for a CPU more than
        WATCH_QUEUED_SHARE of the time: on a node with a core per rank, never; what a step
        that queued less leaves in its compute is below that share."""
        self.current_step = step
        if self.timeline is not None:
            self.timeline.mark(step)
        outside = self.cpu_wait_outside_ns()
        local = self._local
        now, total = time.monotonic_ns(), outside + local.cpu_wait_in_ops_ns
        if local.marked_ns:
            queued = total - local.marked_wait_ns
            local.watch_ops = queued > WATCH_QUEUED_SHARE * (now - local.marked_ns)
        local.marked_ns, local.marked_wait_ns = now, total
        return outside

    def cpu_wait_outside_ns(self) -> int:
        """How long the calling thread has waited runnable for a CPU outside blocking
        communication (a wait inside it is already part of the op's time): the host's
        share of the thread's compute time. A thread is followed from its first call."""
        local = self._local
        if local.cpu_wait is None:
            local.cpu_wait = ThreadCpuWait()
        return local.cpu_wait.ns() - local.cpu_wait_in_ops_ns

    def take_wait_ns(self, before_step: int) -> dict[int, int]:
        """Wait time of the steps before ``before_step`` (removed from the tracer)."""
        done = {s: ns for s, ns in list(self._wait_ns.items()) if s < before_step}
        for s in done:
            self._wait_ns.pop(s, None)
        return done

    # ----------------------------------------------------------------- records
    def exit_many(self, indices: tuple[int, ...], state: int) -> None:
        if state == STATE_ERROR:
            self.failed_ops += len(indices)
        try:
            for i in indices:
                self.board.exit(i, state)
        except Exception as exc:  # noqa: BLE001
            report_error("tracer.exit", exc)

    def _track(
        self, work: Any, indices: tuple[int, ...], cuda: bool, dev: DeviceOp | None = None
    ) -> TracedWork:
        """Async work, its exit stamped when it completes: by the poller, or by the device
        timeline for an op it follows (``dev``)."""
        # The call has returned: later NCCL calls on this thread are not part of this op.
        _native.clear_current_trace()
        tw = TracedWork(work, indices, self, cuda, dev)
        if dev is None:
            self._poller.watch(tw)
        return tw

    def _arrive(self, tl: DeviceTimeline | None) -> int:
        """The event before a device op (-1: none, the op goes untimed)."""
        return -1 if tl is None else tl.arrive(self.current_step)

    def _follow(
        self, tl: Any, indices: tuple[int, ...], pre: int, works: list[Any], blocking: bool
    ) -> DeviceOp | None:
        """Hand a timed device op (``pre`` >= 0) to the timeline, which stamps its exit: a
        blocking op with an event after it, async ones (or a blocking one without that
        event) with their works. None for an untimed op."""
        if pre < 0:
            return None
        _native.clear_current_trace()  # the call has returned (as _track says)
        step = self.current_step
        post = tl.arrive(step) if blocking else -1
        parts = [] if post >= 0 else list(zip(indices, works, strict=True))
        dev = DeviceOp(indices, step, pre, post, parts)
        tl.follow(dev)
        return dev

    def _next_p2p_seq(self, slot: int, peer: int, send: bool) -> int:
        key = (slot, peer, send)
        seq = self._p2p_seq.get(key, 0) + 1
        self._p2p_seq[key] = seq
        return seq

    def _call(
        self, orig: Callable, args: tuple, kwargs: dict, indices: tuple[int, ...], cpu: bool
    ) -> Any:
        """The call around every traced op, once its record is on the board: the original,
        with the thread marked busy (what it calls is part of the op), its records failed
        if it raises. ``cpu``: a blocking CPU op, whose wait for a CPU is booked to it."""
        local = self._local
        local.busy = True
        queued = cpu_wait_now(local) if cpu else -1
        try:
            return orig(*args, **kwargs)
        except BaseException:
            self.exit_many(indices, STATE_ERROR)
            raise
        finally:
            local.busy = False
            book_cpu_wait(local, queued)

    # ----------------------------------------------------------------- wrappers
    def _wrap_collective(self, name: str, orig: Callable) -> Callable:
        code = OP_CODES[name]
        group_at, async_at, tensor_at, tensor_name, is_list = _COLLECTIVES[name]
        local, board, entries = self._local, self.board, self._entries
        enter, exit_ = board.enter, board.exit

        def traced(*args: Any, **kwargs: Any) -> Any:
            if local.busy:  # part of a traced op that is already on the board
                if local.coalesced_index >= 0:
                    _add_coalesced_bytes(
                        board, local, args, kwargs, tensor_at, tensor_name, is_list
                    )
                return orig(*args, **kwargs)
            try:
                if self.before_op is not None:
                    self.before_op()
                group = args[group_at] if len(args) > group_at else kwargs.get("group")
                e = entries.get(group) or self.entry(group)
                if e is None:
                    return orig(*args, **kwargs)
                asked_async = async_at is not None and bool(
                    args[async_at] if len(args) > async_at else kwargs.get("async_op", False)
                )
                cuda = e.cuda or (e.mixed and _first_is_cuda(args))
                pre = self._arrive(e.timeline) if cuda else -1
                flags = (FLAG_ASYNC if asked_async else 0) | (FLAG_CUDA if cuda else 0)
                flags |= FLAG_DEVICE if pre >= 0 else 0
                if tensor_at is None:
                    nbytes = 0
                else:  # inlined: this is the hot path of every collective
                    t = args[tensor_at] if len(args) > tensor_at else kwargs[tensor_name]
                    nbytes = sum(x.nbytes for x in t) if is_list else t.nbytes
                index = enter(e.slot, code, flags, nbytes)
            except Exception as exc:  # noqa: BLE001
                report_error(f"tracer.{name}", exc)
                return orig(*args, **kwargs)
            if cuda and async_at is not None and not asked_async:
                args, kwargs = _force_async(args, kwargs, async_at)
            result = self._call(orig, args, kwargs, (index,), not (asked_async or cuda))
            if cuda and async_at is not None:
                if asked_async:
                    dev = self._follow(e.timeline, (index,), pre, [result], False)
                    return self._track(result, (index,), True, dev)
                result.wait()  # orders the streams; timed: the event after it ends the op
                if self._follow(e.timeline, (index,), pre, [result], True) is None:
                    self._track(result, (index,), True)
                return None
            if asked_async and result is not None:
                return self._track(result, (index,), False)
            exit_(index, STATE_DONE)
            return result

        return traced

    def _wrap_p2p(self, name: str, orig: Callable) -> Callable:
        code = OP_CODES[name]
        sends, always_async, peer_kw, group_peer_kw = _P2P[name]
        local, board = self._local, self.board
        flag = FLAG_P2P | (FLAG_SEND if sends else 0) | (FLAG_ASYNC if always_async else 0)

        def traced(*args: Any, **kwargs: Any) -> Any:
            if local.busy:
                return orig(*args, **kwargs)
            try:
                if self.before_op is not None:
                    self.before_op()
                group = _arg(args, kwargs, 2, "group")
                e = self._entries.get(group) or self.entry(group)
                if e is None:
                    return orig(*args, **kwargs)
                peer = _peer_rank(
                    group, _arg(args, kwargs, 1, peer_kw), _arg(args, kwargs, 4, group_peer_kw)
                )
                tensor = _arg(args, kwargs, 0, "tensor")
                cuda = e.cuda or (e.mixed and tensor.is_cuda)
                pre = self._arrive(e.timeline) if cuda else -1
                flags = flag | (FLAG_CUDA if cuda else 0) | (FLAG_DEVICE if pre >= 0 else 0)
                seq = self._next_p2p_seq(e.slot, peer, sends)
                index = board.enter_p2p(e.slot, code, flags, _nbytes(tensor), peer, seq)
            except Exception as exc:  # noqa: BLE001
                report_error(f"tracer.{name}", exc)
                return orig(*args, **kwargs)
            result = self._call(orig, args, kwargs, (index,), not (always_async or cuda))
            if always_async and result is not None:
                dev = self._follow(e.timeline, (index,), pre, [result], False)
                return self._track(result, (index,), cuda, dev)
            if self._follow(e.timeline, (index,), pre, [None], True) is None:
                board.exit(index, STATE_DONE)
            return result

        return traced

    def _wrap_batch(self, orig: Callable) -> Callable:
        local, board = self._local, self.board
        isend = orig_isend = None

        def traced(p2p_op_list: list) -> Any:
            nonlocal isend, orig_isend
            if local.busy:
                return orig(p2p_op_list)
            try:
                if self.before_op is not None:
                    self.before_op()
                if isend is None:
                    isend, orig_isend = self._wrappers["isend"], self._originals["isend"]
                indices, cuda, tl, pre = [], False, None, -1
                for op in p2p_op_list:
                    e = self._entries.get(op.group) or self.entry(op.group)
                    if e is None:
                        continue
                    sends = op.op is isend or op.op is orig_isend
                    peer = _peer_rank(op.group, op.peer, getattr(op, "group_peer", None))
                    op_cuda = e.cuda or (e.mixed and op.tensor.is_cuda)
                    if op_cuda and tl is None and e.timeline is not None:  # one event: the batch's
                        tl, pre = e.timeline, self._arrive(e.timeline)
                    cuda = cuda or op_cuda
                    flags = (
                        FLAG_P2P
                        | FLAG_ASYNC
                        | (FLAG_SEND if sends else 0)
                        | (FLAG_CUDA if op_cuda else 0)
                        | (FLAG_DEVICE if op_cuda and pre >= 0 else 0)
                    )
                    code = OP_CODES["isend" if sends else "irecv"]
                    seq = self._next_p2p_seq(e.slot, peer, sends)
                    indices.append(
                        board.enter_p2p(e.slot, code, flags, _nbytes(op.tensor), peer, seq)
                    )
            except Exception as exc:  # noqa: BLE001
                report_error("tracer.batch_isend_irecv", exc)
                return orig(p2p_op_list)
            works = self._call(orig, (p2p_op_list,), {}, tuple(indices), False)
            one_each = bool(works) and len(works) == len(indices)
            # coalesced into fewer works: every record completes with the last of them
            last = [works[-1] if works else None] * len(indices)
            dev = self._follow(tl, tuple(indices), pre, works if one_each else last, False)
            if not works:
                if dev is None:
                    self.exit_many(tuple(indices), STATE_DONE)
                return works
            if one_each:
                return [
                    self._track(w, (i,), cuda, dev) for w, i in zip(works, indices, strict=True)
                ]
            tracked = [self._track(w, (), cuda, dev) for w in works[:-1]]
            tracked.append(self._track(works[-1], tuple(indices), cuda, dev))
            return tracked

        return traced

    def _wrap_coalescing_manager(self, orig: Callable) -> Callable:
        local, board = self._local, self.board
        code = OP_CODES["coalesced"]

        @contextlib.contextmanager
        def traced(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator:
            if local.busy:
                with orig(group, device, async_ops) as cm:
                    yield cm
                return
            try:
                e = self._entries.get(group) or self.entry(group)
                index = (
                    -1
                    if e is None
                    else board.enter(e.slot, code, FLAG_ASYNC if async_ops else 0, 0)
                )
            except Exception as exc:  # noqa: BLE001
                report_error("tracer._coalescing_manager", exc)
                index = -1
            local.busy, local.coalesced_index = True, index
            queued = -1 if index < 0 or e is None or async_ops or e.cuda else cpu_wait_now(local)
            try:
                with orig(group, device, async_ops) as cm:
                    yield cm
            except BaseException:
                if index >= 0:
                    self.exit_many((index,), STATE_ERROR)
                raise
            finally:
                local.busy, local.coalesced_index = False, -1
                book_cpu_wait(local, queued)
            if index < 0:
                return
            assert e is not None  # the op was entered (index >= 0) on e's slot
            works = getattr(cm, "works", None) or []
            if async_ops and works:
                for w in works[:-1]:
                    self._track(w, (), False)
                self._track(works[-1], (index,), e.cuda)
            else:
                board.exit(index, STATE_DONE)

        return traced

    # ----------------------------------------------------------------- install
    def install(self) -> None:
        for name in WRAPPED_NAMES:
            orig = getattr(c10d, name, None)
            if orig is None:
                continue  # not in this torch release
            self._originals[name] = orig
        for name, orig in self._originals.items():
            if name in _COLLECTIVES:
                w = self._wrap_collective(name, orig)
            elif name in _P2P:
                w = self._wrap_p2p(name, orig)
            elif name == "batch_isend_irecv":
                w = self._wrap_batch(orig)
            else:
                w = self._wrap_coalescing_manager(orig)
            w.__name__ = w.__qualname__ = name
            w.__doc__ = orig.__doc__
            w.__wrapped__ = orig  # type: ignore[attr-defined]  # as functools.wraps sets it
            self._wrappers[name] = w
        rebind({id(o): (o, self._wrappers[n]) for n, o in self._originals.items()})
        self._functional.install()

    def uninstall(self) -> None:
        self._functional.uninstall()
        rebind({id(w): (w, self._originals[n]) for n, w in self._wrappers.items()})
        self._poller.stop()
        self._wrappers.clear()


# ---------------------------------------------------------------------- helpers
def _first_is_cuda(args: tuple) -> bool:
    first = args[0] if args else None
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return bool(getattr(first, "is_cuda", False))


def _force_async(args: tuple, kwargs: dict, async_at: int) -> tuple[tuple, dict]:
    if len(args) > async_at:
        args = (*args[:async_at], True, *args[async_at + 1 :])
    else:
        kwargs = {**kwargs, "async_op": True}
    return args, kwargs


def _peer_rank(group: Any, peer: int | None, group_peer: int | None) -> int:
    if peer is not None:
        return int(peer)
    if group_peer is not None:
        return int(dist.get_global_rank(group or c10d._get_default_group(), group_peer))
    return NO_RANK


def _add_coalesced_bytes(
    board: Any,
    local: ThreadState,
    args: tuple,
    kwargs: dict,
    tensor_at: int | None,
    tensor_name: str,
    is_list: bool,
) -> None:
    try:
        board.add_bytes(
            local.coalesced_index, _op_bytes(args, kwargs, tensor_at, tensor_name, is_list)
        )
    except Exception as exc:  # noqa: BLE001
        report_error("tracer.coalesced", exc)
