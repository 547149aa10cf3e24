"""One rank's part in its node's summaries: it hands its summary to the node (its summary
file, ``node_board``), and when it leads the node, gathers the node's summaries into the
frame it publishes (``wire.node_summary``).

Agent ticks are aligned on the diagnoser's clock, so the node's ranks write their files
at about the moment the leader gathers them: the leader waits, a bounded share of an
interval, for each rank that wrote at the last tick to write at this one, so that the
frame carries this tick's summaries and not the last's.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

from ccld_plugin.agent.board_summary import as_board_stands
from ccld_plugin.agent.node_board import (
    EXITED,
    FRESH_TICKS,
    LocalSummary,
    choose_leader,
    network_namespace,
    read_local,
    remove_local,
    summary_path,
    write_local,
)
from ccld_plugin.board.job_files import board_file
from ccld_plugin.board.process import process_alive
from ccld_plugin.errors import report_error
from ccld_plugin.wire.node_summary import encode_node, node_of, node_ranks
from ccld_plugin.wire.summary import decode_summary, encode_summary

__all__ = ["GATHER_SHARE", "NodeShare"]

GATHER_SHARE = 0.25  # of an interval: how long a leader waits for this tick's summaries
POLL_S = 0.005


class NodeShare:
    def __init__(
        self,
        board_path: Path,
        rank: int,
        world: int,
        ranks_per_node: int,
        pid: int,
        interval_s: float,
        stop: threading.Event,
    ) -> None:
        self.rank = rank
        self.node = node_of(rank, ranks_per_node)
        self.pid = pid
        self._gather_s = GATHER_SHARE * interval_s
        self._stop = stop
        self._path = summary_path(board_path)
        self._boards = {
            r: board_file(board_path.parent, r)
            for r in node_ranks(self.node, ranks_per_node, world)
            if r != rank
        }
        self._others = {r: summary_path(b) for r, b in self._boards.items()}
        self._final: dict[tuple[int, int, int], bytes] = {}  # (rank, pid, tick): see _last_words
        self._written = False
        self.net = network_namespace()

    def hand(self, summary: bytes, tick: int, job_start_ns: int, flags: int) -> bool:
        """Write this rank's summary for the node's leader; False when there is none (a rank
        alone on its node) or it cannot be written (counted): the rank then publishes its
        own key, which is cheaper than a frame of one."""
        if not self._others:
            return False
        try:
            write_local(
                self._path, LocalSummary(flags, self.pid, tick, job_start_ns, self.net, summary)
            )
        except OSError as exc:
            report_error("agent.node_summary", exc)
            return False
        self._written = True
        return True

    def leader(self, tick: int, job_start_ns: int) -> int | None:
        """Who leads this rank's node at ``tick`` (``node_board.choose_leader``; None: this
        rank publishes its own key). A lower rank's file that is not there yet (the first
        tick: every rank writes at the same moment) is waited for, a share of an interval."""
        deadline = time.monotonic() + self._gather_s

        def read(rank: int) -> LocalSummary | None:
            s = read_local(self._others[rank])
            while s is None and time.monotonic() < deadline and not self._stop.wait(POLL_S):
                s = read_local(self._others[rank])
            return s

        lower = sorted(r for r in self._others if r < self.rank)
        alive = functools.partial(process_alive, host="")  # the node's ranks run on this host
        return choose_leader(self.rank, lower, read, tick, job_start_ns, self.net, alive)

    def frame(self, summary: bytes, tick: int, job_start_ns: int) -> bytes:
        """The node's frame at ``tick``: this rank's summary and the latest of each other
        rank of the node, of this run and this network namespace (a dead rank's stays in,
        as its key would: ``_last_words``)."""
        files: dict[int, LocalSummary] = {}
        waiting = set(self._others)
        deadline = time.monotonic() + self._gather_s
        while waiting:
            for r in sorted(waiting):
                s = read_local(self._others[r])
                if s is None or not s.of_node(job_start_ns, self.net):
                    waiting.discard(r)
                    continue
                files[r] = s
                if s.tick >= tick or s.flags & EXITED or s.tick < tick - FRESH_TICKS:
                    waiting.discard(r)  # current, gone, or not writing: nothing to wait for
            if not waiting or time.monotonic() >= deadline or self._stop.wait(POLL_S):
                break
        found = {r: self._last_words(r, s, s.tick < tick - FRESH_TICKS) for r, s in files.items()}
        return encode_node(sorted({**found, self.rank: summary}.items()))

    def _last_words(self, rank: int, s: LocalSummary, stale: bool) -> bytes:
        """``rank``'s summary as its file holds it; once its process is gone without
        leaving through the exit path, as its board stood when it died (read once): its
        last file can be an interval older than that, and a job that kills a rank (the
        OOM killer, a failed assertion in C++) wants to know the step and op it died in,
        not where it was a tick before (seen: a rank of a DeepSpeed job killed at step 6
        named at step 0, with no op, from a summary written before its first step). A
        live process whose file is ``stale`` (stopped, or its agent wedged) is told as its
        board stands at each tick, for the same reason (a rank frozen at step 5 was named
        at step 0)."""
        if s.flags & EXITED:
            return s.summary
        alive = process_alive(s.pid, host="")
        if alive is None or (alive and not stale):
            return s.summary
        if alive:  # it may go on: read its board at every tick
            return self._as_board_stands(rank, s, died=False)
        key = (rank, s.pid, s.tick)
        if key not in self._final:
            self._final[key] = self._as_board_stands(rank, s, died=True)
        return self._final[key]

    def _as_board_stands(self, rank: int, s: LocalSummary, died: bool) -> bytes:
        """``rank``'s last summary brought up to its board (``final_summary``); its file's
        as it is when the board is another run's or cannot be read (counted)."""
        try:
            now = as_board_stands(self._boards[rank], s.pid, decode_summary(s.summary), died)
            if now is not None:
                return encode_summary(now)
        except Exception as exc:  # noqa: BLE001 - its last file stands
            report_error("agent.last_words", exc)
        return s.summary

    def remove(self) -> None:
        if self._written:
            remove_local(self._path)
