"""A board's state as a :class:`RankSummary`: the part of the agent's tick that needs
nothing but the board, shared by the live agent and the post-mortem (``ccld diagnose``),
so both hand the diagnoser the same record for the same board.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ccld_plugin.board.reader import BoardHeader, BoardReader
from ccld_plugin.wire.codes import (
    FLAG_ASYNC,
    FLAG_DEVICE,
    FLAG_P2P,
    STATE_DONE,
    STATE_ERROR,
    STATE_IN_FLIGHT,
    TIME_HOST,
)
from ccld_plugin.wire.summary import (
    FLAG_ERRORED,
    FLAG_EXITED,
    FLAG_LAST_WORDS,
    ArrivalSample,
    GroupProgress,
    InFlightOp,
    RankSummary,
)

__all__ = [
    "BoardSnapshot",
    "arrival_samples",
    "final_summary",
    "in_flight_ops",
    "last_seen_ns",
    "on_device",
    "sampled",
    "samples_per_group",
    "stuck_s",
    "summarize_board",
]

MAX_IN_FLIGHT = 8
# Arrival samples per group per tick: dense in small jobs, where a window of steps spans
# few ticks and a two-rank cohort's verdict rests on the arrival order alone (8 per tick
# left 2-5 joined samples in a 5-step window of a 4-rank demo), and down to 2 at tens of
# thousands of ranks, where the diagnoser's round joins every rank's samples (8 per group
# made ~0.5 million a round at 16,384 ranks, a quarter of the round); a straggler's span
# of 10 ticks still holds 20 of its collectives per group.
SAMPLE_BUDGET = 32768  # per group slot, over all ranks
MIN_SAMPLES, MAX_SAMPLES = 2, 128


@dataclass(frozen=True)
class BoardSnapshot:
    """One read of a board: its header, op records (oldest first) and group table."""

    header: BoardHeader
    ops: np.ndarray
    table: np.ndarray

    @classmethod
    def read(cls, reader: BoardReader) -> BoardSnapshot:
        header = reader.header()
        ops = reader.ops()
        table = reader.group_table()  # after the ops: its completed seqs cover them
        return cls(header, ops, table)


def in_flight_ops(records: Iterable[Any], offset_ns: int = 0) -> list[InFlightOp]:
    """Board op records as a summary's in-flight ops, their enter time on the diagnoser's
    clock (``offset_ns``: the rank's clock minus the diagnoser's)."""
    return [
        InFlightOp(
            int(r["group_slot"]),
            int(r["op"]),
            int(r["flags"]),
            int(r["peer"]),
            int(r["seq"]),
            int(r["bytes"]),
            int(r["enter_ns"]) - offset_ns,
            int(r["state"]),
        )
        for r in records
    ]


def summarize_board(
    snap: BoardSnapshot,
    now_ns: int,
    since_ns: int,
    offset_ns: int,
    groups_version: int,
    exited: bool = False,
) -> RankSummary:
    """The summary of ``snap`` at ``now_ns`` (this rank's monotonic clock), counting the
    ops completed after ``since_ns``; times in it are on the diagnoser's clock (this rank's
    minus ``offset_ns``). Steps, arrival samples, channels and the stack are the caller's
    to add: they need the live process or a history the board does not keep."""
    h, ops = snap.header, snap.ops
    done = on_device(ops[(ops["state"] == STATE_DONE) & (ops["exit_ns"] > since_ns)])
    sync = (done["flags"] & FLAG_ASYNC) == 0
    dur_ns = done["exit_ns"] - done["enter_ns"]
    flights, entered = _device_flights(ops[ops["state"] == STATE_IN_FLIGHT], snap.table)
    progress = []
    for slot, rec in enumerate(snap.table):
        mine = done["group_slot"] == slot
        progress.append(
            GroupProgress(
                slot=slot,
                entered_seq=entered[slot],
                completed_seq=int(rec["completed_seq"]),
                ops=int(mine.sum()),
                # summed in floats: a ring of ops each as long as a corrupt (or remote)
                # board's times allow passes 64 bits
                blocked_us=int(dur_ns[mine & sync].sum(dtype=np.float64) // 1000),
                bytes=int(done["bytes"][mine].sum()),
                max_dur_us=int(dur_ns[mine].max() // 1000) if mine.any() else 0,
            )
        )
    errors = ops[ops["state"] == STATE_ERROR][-2:]
    in_flight = in_flight_ops([*flights[:MAX_IN_FLIGHT], *errors], offset_ns)
    last_exit = int(ops["exit_ns"].max()) if len(ops) else 0
    last_progress = max(h.start_mono_ns, h.step_start_ns, last_exit)
    flags = (FLAG_EXITED if exited else 0) | (FLAG_ERRORED if len(errors) else 0)
    return RankSummary(
        rank=h.rank,
        pid=h.pid,
        host=h.host,
        time_ns=now_ns - offset_ns,
        heartbeat_ns=now_ns - offset_ns,
        step=h.step,
        last_progress_ns=last_progress - offset_ns,
        groups_version=groups_version,
        flags=flags,
        errors=h.errors,
        groups=progress,
        in_flight=in_flight,
    )


def on_device(ops: np.ndarray) -> np.ndarray:
    """Completed ops as the device ran them: one the device timeline follows (FLAG_DEVICE)
    entered when the device reached it and left when it finished there, and is left out
    while its device times are not known; others as the host saw them."""
    dev = (ops["flags"] & FLAG_DEVICE) != 0
    if not dev.any():
        return ops
    out = ops[~dev | ((ops["dev_start_ns"] > 0) & (ops["dev_end_ns"] > 0))].copy()
    dev = (out["flags"] & FLAG_DEVICE) != 0
    out["enter_ns"][dev] = out["dev_start_ns"][dev]
    out["exit_ns"][dev] = out["dev_end_ns"][dev]
    return out


def _device_flights(flights: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Ops in flight as the device sees them, and each group's entered seq: a device-timed
    op the device has not reached yet is not entered (the host only queued it: a device
    stuck before it is the rank its peers wait for), one it has reached entered then."""
    entered = [int(seq) for seq in table["entered_seq"]]
    dev = (flights["flags"] & FLAG_DEVICE) != 0
    if not dev.any():
        return flights, entered
    unreached = dev & (flights["dev_start_ns"] == 0)
    for r in flights[unreached & ((flights["flags"] & FLAG_P2P) == 0)]:
        slot = int(r["group_slot"])
        if slot < len(entered):
            entered[slot] = min(entered[slot], int(r["seq"]) - 1)
    reached = flights[~unreached].copy()
    dev = (reached["flags"] & FLAG_DEVICE) != 0
    reached["enter_ns"][dev] = reached["dev_start_ns"][dev]
    return reached, entered


def arrival_source(done: np.ndarray) -> int:
    """Where the arrival times of ``done`` (a tick's completed ops) come from: the source
    of most of the device-timed ones' starts, or host clocks."""
    src = done["dev_source"][(done["flags"] & FLAG_DEVICE) != 0] & 0xF
    src = src[src > 0]
    return int(np.bincount(src).argmax()) if len(src) else TIME_HOST


def samples_per_group(world: int) -> int:
    """Arrival samples each rank sends per group and tick in a job of ``world`` ranks."""
    return max(MIN_SAMPLES, min(MAX_SAMPLES, SAMPLE_BUDGET // max(1, world)))


def arrival_samples(
    done: np.ndarray, keep: int, to_diag: Callable[[int], int]
) -> list[ArrivalSample]:
    """Arrival samples of the completed ops ``done``: per group, about ``keep`` of its
    collectives, picked by their seq (``sampled``): members pick the same seqs, so the
    diagnoser can join them across ranks. Times by ``to_diag`` on the diagnoser's clock."""
    coll = done[(done["flags"] & FLAG_P2P) == 0]
    out = []
    for slot in np.unique(coll["group_slot"]):
        recs = sampled(coll[coll["group_slot"] == slot], keep)
        out += [
            ArrivalSample(
                int(slot),
                int(r["seq"]),
                to_diag(int(r["enter_ns"])),
                int((r["exit_ns"] - r["enter_ns"]) // 1000),
                int(r["bytes"]),
            )
            for r in recs
        ]
    return out


def sampled(ops: np.ndarray, keep: int) -> np.ndarray:
    """The last ``keep`` of ``ops`` (one sequence of seqs) whose seq, mixed, is a multiple
    of the power of two that leaves about ``keep`` of them: every rank that reports the
    same sequence picks the same seqs (a larger power's multiples are a smaller's subset).
    Mixed, because a step runs a fixed number of ops in each group: the multiples of 2 of
    a TP group's 16 all-reduces a step were the same 8 of every step, where its peer was
    always last, and a 1.5x straggler late at the other 8 went unnamed."""
    every = 1 << max(0, int(np.ceil(np.log2(max(1, len(ops)) / keep))))
    return ops[_mixed(ops["seq"]) % np.uint64(every) == 0][-keep:]


def _mixed(seq: np.ndarray) -> np.ndarray:
    """``seq``'s bits spread over all 64 (splitmix64's finalizer): no period left in them."""
    x = seq.astype(np.uint64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def last_seen_ns(snap: BoardSnapshot) -> int:
    """The last moment the board's rank is known to have run (its clock): its agent's
    heartbeat, or a later op or step of its main thread."""
    h, ops = snap.header, snap.ops
    last_op = int(max(ops["enter_ns"].max(), ops["exit_ns"].max())) if len(ops) else 0
    return max(h.heartbeat_ns, h.step_start_ns, h.start_mono_ns, last_op)


def final_summary(snap: BoardSnapshot, last: RankSummary, died: bool = True) -> RankSummary:
    """The summary of a rank whose process died (``died``; else one stopped, its agent
    silent), as its board stood then: ``last`` (made by its own agent, up to an interval
    before) brought up to its last step and op. Its heartbeat stays ``last``'s, as its
    agent beat no more; what only the live process knew (its step times, its sockets, its
    stack) stays ``last``'s too. A dead rank's is flagged its last words; one whose board
    is closed left through the exit path (its final summary may never have reached the
    store: a store hosted by rank 0 ends with it) and is flagged exited."""
    offset = snap.header.clock_offset_ns
    since = last.time_ns + offset  # on the rank's clock: ops done after ``last`` count
    s = summarize_board(snap, max(last_seen_ns(snap), since), since, offset, last.groups_version)
    s.heartbeat_ns = last.heartbeat_ns
    s.host, s.steps, s.stack = last.host, last.steps, last.stack
    s.time_source = last.time_source  # what its steps' figures are
    if snap.header.closed:
        s.flags |= FLAG_EXITED
    elif died:
        s.flags |= FLAG_LAST_WORDS
    return s


def as_board_stands(
    board: str | os.PathLike[str], pid: int, last: RankSummary, died: bool
) -> RankSummary | None:
    """``last`` brought up to the rank's board as it stands (:func:`final_summary`), or
    None when the board is not process ``pid``'s (a later run's)."""
    with BoardReader(board) as reader:
        snap = BoardSnapshot.read(reader)
    return final_summary(snap, last, died) if snap.header.pid == pid else None


def stuck_s(s: RankSummary) -> float:
    """How long the rank has been in its oldest op, or without progress, at ``s.time_ns``."""
    since = min(
        [op.enter_ns for op in s.in_flight if op.state == STATE_IN_FLIGHT] + [s.last_progress_ns]
    )
    return max(0.0, (s.time_ns - since) / 1e9)
