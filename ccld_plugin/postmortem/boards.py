"""The boards of one job, read for a post-mortem: every rank's board at a path, checked to
belong to one run of one job, on one timebase (the diagnoser's clock, through each
board's clock offset)."""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ccld_plugin.agent.board_summary import BoardSnapshot, last_seen_ns
from ccld_plugin.board.job_files import read_crash, read_stack, stack_path
from ccld_plugin.board.reader import BoardError, BoardReader, board_files
from ccld_plugin.files import OneLineError, kind_of
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.codes import FLAG_P2P, STATE_DONE, STATE_ERROR, STATE_IN_FLIGHT

__all__ = ["JobBoards", "PostmortemError", "RankBoard", "load_boards"]

MISSING_LISTED = 16  # ranks without a board named in a note; more are counted

# Ranks of one run create their boards right after the rendezvous; a board that started
# this much earlier than the job's others is left over from an earlier run of a job of the
# same name.
STALE_START_S = 120.0


class PostmortemError(OneLineError):
    """Boards that cannot be diagnosed together; the message is one line with the fix."""


@dataclass
class RankBoard:
    path: Path
    snap: BoardSnapshot
    groups: list[GroupInfo]
    channels: np.ndarray
    stack: list[str]  # the main-thread stack the rank wrote while stuck, if any
    crash: list[str]  # the uncaught exception it left on, if it did (job_files.write_crash)
    # records left out per table as failing their checks (BoardReader.corrupt), if any
    corrupt: dict[str, int] = field(default_factory=dict)

    @property
    def offset_ns(self) -> int:
        return self.snap.header.clock_offset_ns

    def diag(self, mono_ns: int) -> int:
        """A time of this rank's clock on the diagnoser's."""
        return mono_ns - self.offset_ns

    def last_seen_ns(self) -> int:
        """The last moment the rank is known to have run (its clock): its agent's heartbeat,
        or a later op or step of its main thread."""
        return last_seen_ns(self.snap)

    def failed_ns(self) -> int | None:
        """When the rank's first collective raised (its clock), if one did."""
        failed = self._failed()
        return int(failed["exit_ns"].min()) if len(failed) else None

    def failed_with(self) -> set[int]:
        """The ranks the rank's first op that raised was with: its peer (a transfer) or its
        group's other members; none if no op raised."""
        failed = self._failed()
        if not len(failed):
            return set()
        first = failed[int(np.argmin(failed["exit_ns"]))]
        if first["flags"] & FLAG_P2P:
            return {int(first["peer"])}
        slot = int(first["group_slot"])
        members = self.groups[slot].ranks if 0 <= slot < len(self.groups) else ()
        return set(members) - {self.snap.header.rank}

    def _failed(self) -> np.ndarray:
        """The rank's ops that raised."""
        ops = self.snap.ops
        return ops[ops["state"] == STATE_ERROR]

    def as_of(self, cut_ns: int) -> RankBoard:
        """The board as it stood at ``cut_ns`` (diagnoser's clock): ops entered later are
        not there yet, ops that ended later (or raised) are still in flight, the group
        counters and the heartbeat go back with them. A job whose collectives timed out is
        judged at its first timeout, when every rank still waited where it was stuck; what
        the timeouts set off afterwards (ranks raising, exiting, being killed) is not the
        fault."""
        cut = cut_ns + self.offset_ns  # on this rank's clock
        h, every = self.snap.header, self.snap.ops
        entered = every["enter_ns"] <= cut
        done = (every["state"] == STATE_DONE) & (every["exit_ns"] <= cut)
        ops = every[entered].copy()
        ops["state"][~done[entered]] = STATE_IN_FLIGHT
        ops["exit_ns"][~done[entered]] = 0
        # each group's counters go back to its first collective not entered, or not done,
        # by the cut (point-to-point ops keep counters of their own)
        table = self.snap.table.copy()
        collective = (every["flags"] & FLAG_P2P) == 0
        for slot in range(len(table)):
            mine = collective & (every["group_slot"] == slot)
            for counter, by_cut in (("entered_seq", entered), ("completed_seq", done)):
                later = every["seq"][mine & ~by_cut]
                if len(later):
                    table[counter][slot] = min(int(table[counter][slot]), int(later.min()) - 1)
        seen = self.last_seen_ns()
        header = replace(
            h,
            heartbeat_ns=min(h.heartbeat_ns, cut),
            step_start_ns=min(h.step_start_ns, cut),
            closed=h.closed and seen <= cut,
        )
        snap = BoardSnapshot(header, ops, table)
        return replace(self, snap=snap, crash=self.crash if header.closed else [])


@dataclass
class JobBoards:
    job: str
    world: int
    ranks: dict[int, RankBoard]
    notes: list[str] = field(default_factory=list)  # one line each: what is missing or skipped
    # one line each: the boards (and folders) at the path that could not be read
    unreadable: list[str] = field(default_factory=list)

    def missing(self, limit: int = MISSING_LISTED) -> list[int]:
        """The first ``limit`` ranks of the job without a board here (a corrupt world can
        be 2**31 ranks: never listed whole)."""
        return list(itertools.islice((r for r in range(self.world) if r not in self.ranks), limit))

    def damaged(self) -> list[RankBoard]:
        """The boards read with corrupt records left out."""
        return [b for _, b in sorted(self.ranks.items()) if b.corrupt]


def load_boards(path: Path, *more: Path) -> JobBoards:
    """Read every board at ``path`` (a board file or a directory of them) and at ``more``
    (the folders of the job's other hosts, each kept on its own host)."""
    read: list[RankBoard] = []
    unreadable: list[str] = []
    for where in (path, *more):
        files = _board_files_at(where, unreadable)
        for f in files:
            try:
                read.append(_read(f, unreadable))
            except BoardError as exc:
                unreadable.append(str(exc))
        if not more and files == [path] and unreadable:
            raise PostmortemError(unreadable[0])  # one board, not a folder: why unreadable
    shown = ", ".join(str(p) for p in (path, *more))
    if not read:
        why = f" ({len(unreadable)} unreadable, the first: {unreadable[0]})" if unreadable else ""
        raise PostmortemError(
            f"no readable board (*.board) at {shown}{why}; boards are in <board.dir>/<job>/ "
            "(default /dev/shm/ccld-<uid>/<job>/)"
        )
    jobs: dict[tuple[str, int], list[RankBoard]] = {}
    for b in read:
        jobs.setdefault((b.snap.header.job, b.snap.header.world), []).append(b)
    if len(jobs) > 1:
        listed = ", ".join(
            f"{job!r} of world {world} ({len(bs)} boards)" for (job, world), bs in jobs.items()
        )
        raise PostmortemError(
            f"boards of {len(jobs)} different jobs at {shown}: {listed}; "
            "pass the directories of one job"
        )
    ((job, world),) = jobs
    notes: list[str] = []
    ranks = _one_run(read, notes)
    boards = JobBoards(job, world, ranks, notes, unreadable)
    absent = world - len(ranks)
    if absent:
        first = boards.missing()
        which = f"rank(s) {first}" if absent <= MISSING_LISTED else f"{absent} ranks ({first}...)"
        notes.append(
            f"no board for {which} of {world}: they are left out of the "
            "analysis (never started, or their boards were removed)"
        )
    return boards


def _board_files_at(path: Path, unreadable: list[str]) -> list[Path]:
    try:
        os.stat(path)
    except FileNotFoundError:
        raise PostmortemError(f"{path} does not exist; pass a job's board directory") from None
    except OSError:
        pass  # the reader says why it cannot be read
    try:
        return board_files(path, unreadable)
    except BoardError as exc:
        raise PostmortemError(str(exc)) from None


def _read(path: Path, unreadable: list[str]) -> RankBoard:
    with BoardReader(path) as r:
        snap = BoardSnapshot.read(r)
        groups, channels = r.groups(), r.channels()  # after the snapshot: counts its tables
        corrupt = {table: n for table, n in r.corrupt.items() if n}
    stack = _frames(path, stack_path(path), read_stack, unreadable)
    crash = _frames(path, path.with_suffix(".crash"), read_crash, unreadable)
    return RankBoard(path, snap, groups, channels, stack, crash, corrupt)


def _frames(
    board: Path, side: Path, read: Callable[[Path], list[str]], unreadable: list[str]
) -> list[str]:
    """``read(board)``: the frames of the file ``side`` beside the board, when it is a
    regular file (or absent); anything else there is left out with a line (reading a
    FIFO would block)."""
    try:
        mode = os.stat(side).st_mode
    except OSError:
        return read(board)  # absent, or unreadable: it reads as no frames
    if stat.S_ISREG(mode):
        return read(board)
    unreadable.append(f"{side}: {kind_of(mode)}, not a regular file; left out")
    return []


def _one_run(boards: list[RankBoard], notes: list[str]) -> dict[int, RankBoard]:
    """One board per rank, all of the newest run of the job."""
    newest = max(b.snap.header.start_wall_ns for b in boards)
    ranks: dict[int, RankBoard] = {}
    for b in sorted(boards, key=lambda b: b.snap.header.start_wall_ns, reverse=True):
        h = b.snap.header
        early_s = (newest - h.start_wall_ns) / 1e9
        if early_s > STALE_START_S:
            notes.append(
                f"skipped {b.path}: rank {h.rank}'s board started {early_s:.0f} s before "
                "the job's newest, so it is from an earlier run of the same job name"
            )
        elif h.rank in ranks:
            raise PostmortemError(
                f"rank {h.rank} has two boards ({ranks[h.rank].path}, {b.path}) of the same "
                "run; pass each folder of one job once"
            )
        else:
            ranks[h.rank] = b
    return ranks
