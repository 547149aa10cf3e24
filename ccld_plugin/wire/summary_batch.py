"""Many rank summaries at once, as columns: what a diagnoser round reads.

At tens of thousands of ranks, one object per rank (and one per group, step and sample of
each) costs more than the whole analysis: :meth:`SummaryTable.decode` checks and decodes
every summary of a round with a few numpy gathers over their joined bytes, into one
array per record kind (header, group progress, in-flight ops, steps, arrival samples),
each row carrying the index of its summary (``row``). The table is also a mapping from
rank to :class:`RankSummary`; a rank's object is decoded only when it is looked up (the
few ranks a verdict is about), so code that needs one summary reads a RankSummary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from ccld_plugin.wire.packed import PackedSummaries, gather, records
from ccld_plugin.wire.peer_channels import ChannelRows, channel_rows, channel_rows_at
from ccld_plugin.wire.summary import (
    FLAG_CRASHED,
    FLAG_DEVICE_TIME,
    FLAG_ERRORED,
    FLAG_EXITED,
    FLIGHT_DTYPE,
    GROUP_DTYPE,
    HEAD_DTYPE,
    MAX_FRAMES,
    MAX_HOST,
    NOT_THIS_VERSION,
    P2P_DTYPE,
    SAMPLE_DTYPE,
    STEP_DTYPE,
    SUMMARY_VERSION,
    RankSummary,
    SummaryError,
    encoded_p2p,
    encoded_samples,
    problems,
    read_frames,
    read_summary,
    sections,
)

__all__ = ["Summaries", "SummaryTable", "table_of"]

_HEAD_FIELDS = ("rank", "pid", "flags", "step", "time_ns", "heartbeat_ns", "last_progress_ns")
# Columns of the per-record arrays: the record's fields as the diagnoser uses them (times
# absolute on the diagnoser's clock), and ``row``, the index of its summary in the table.
_HEADS = np.dtype([(f, "<i8") for f in (*_HEAD_FIELDS, "groups_version")])
_GROUPS = np.dtype(
    [("row", "<i8"), ("slot", "<i8"), ("entered_seq", "<i8"), ("completed_seq", "<i8")]
    + [(f, "<i8") for f in ("ops", "max_dur_us")]
)
_FLIGHTS = np.dtype(
    [("row", "<i8")]
    + [(f, "<i8") for f in ("slot", "op", "flags", "peer", "seq", "enter_ns")]
    + [("state", "<i8")]
)
_STEPS = np.dtype(
    [
        ("row", "<i8"),
        ("step", "<i8"),
        ("start_ns", "<i8"),
        ("step_us", "<i8"),
        ("compute_us", "<i8"),
        ("cpu_wait_us", "<i8"),
        ("host_compute_us", "<i8"),
    ]
)


class SummaryTable(Mapping[int, RankSummary]):
    """The summaries of a round by rank, in rank order, as columns (see the module doc)."""

    def __init__(
        self,
        ranks: np.ndarray,
        heads: np.ndarray,
        groups: np.ndarray,
        flights: np.ndarray,
        steps: np.ndarray,
        samples: np.ndarray,
        sample_rows: np.ndarray,
        p2p: np.ndarray,
        p2p_rows: np.ndarray,
        hosts: tuple[list[str], np.ndarray],
        values: PackedSummaries | list[RankSummary],
        channel_spans: np.ndarray,
    ) -> None:
        self.heads = heads  # _HEADS, one per summary
        self.groups = groups  # _GROUPS
        self.flights = flights  # _FLIGHTS
        self.steps = steps  # _STEPS
        self.samples = samples  # SAMPLE_DTYPE rows, encoded as sent ...
        self.sample_rows = sample_rows  # ... and the row of each
        self.p2p, self.p2p_rows = p2p, p2p_rows  # P2P_DTYPE rows, the same way
        # host names: the distinct ones (a node's ranks share one), and each row's index
        self.host_names, self.host_ids = hosts
        self.ranks = ranks  # the key each summary was read under (heads["rank"]: its own)
        # per row: its encoded value (decoded when looked up) or its summary object, and
        # where its channel evidence lies in the value ([start, end), or -1: the object's)
        self._values = values
        self._channel_spans = channel_spans
        self._index: dict[int, int] | None = None
        self._decoded: dict[int, RankSummary] = {}
        self._channel_rows: ChannelRows | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def decode(cls, raw: Mapping[int, bytes]) -> tuple[SummaryTable, dict[int, str]]:
        """The values of ``raw`` (by rank) that decode; and, by rank, why each other one
        does not (what :func:`decode_summary` would raise for it). Packed values (what the
        control plane reads) are decoded where they lie."""
        packed = PackedSummaries.of(raw)
        blob, starts, lens = packed.blob, packed.starts, packed.lens
        ranks = packed.ranks.tolist()
        n = len(ranks)
        bad: dict[int, str] = {}
        ok = lens >= HEAD_DTYPE.itemsize
        head = gather(blob, np.where(ok, starts, 0), HEAD_DTYPE)
        ok &= head["version"] == SUMMARY_VERSION
        for i in np.flatnonzero(~ok).tolist():
            bad[ranks[i]] = NOT_THIS_VERSION
        ok &= _flagged(
            bad,
            ranks,
            (head["n_host"] > MAX_HOST) | (head["n_frames"] > MAX_FRAMES),
            ok,
            "corrupt ccld summary (host or stack longer than encoded)",
        )
        counts = {
            k: np.where(ok, head[k].astype(np.int64), 0)
            for k in ("n_groups", "n_flights", "n_steps", "n_samples", "n_frames", "n_host")
        }
        at = sections(
            starts + HEAD_DTYPE.itemsize,
            [counts[k] for k in ("n_host", "n_groups", "n_flights", "n_steps", "n_samples")],
        )
        frames_at = at.frames
        n_channels = head["n_channels"].astype(np.int64)
        short = frames_at + 2 * counts["n_frames"] + n_channels > starts + lens
        ok &= _flagged(bad, ranks, short, ok, "corrupt ccld summary (shorter than its counts)")
        for k in counts:
            counts[k] = np.where(ok, counts[k], 0)
        channels_at = frames_at.copy()
        names, host_ids, unreadable = _hosts(blob, at.host, counts["n_host"])
        for i, why in unreadable.items():
            bad[ranks[i]] = f"corrupt ccld summary ({why})"
            ok[i] = False
        for i in np.flatnonzero(ok & (counts["n_frames"] > 0)).tolist():
            try:
                _, end = read_frames(
                    packed.at_row(i), int(frames_at[i] - starts[i]), int(counts["n_frames"][i])
                )
            except SummaryError as exc:
                bad[ranks[i]] = str(exc)
                ok[i] = False
            else:
                channels_at[i] = starts[i] + end
        # point-to-point samples fill the rest (of a value of this version)
        p2p_at = channels_at + n_channels
        rest = starts + lens - p2p_at
        mismatch = ok & ((rest < 0) | (rest % P2P_DTYPE.itemsize != 0))
        ok &= _flagged(bad, ranks, mismatch, ok, "corrupt ccld summary (length mismatch)")
        n_p2p = np.where(ok, rest // P2P_DTYPE.itemsize, 0)
        for k in counts:
            counts[k] = np.where(ok, counts[k], 0)
        heads = np.zeros(n, _HEADS)
        for f in (*_HEAD_FIELDS, "groups_version"):
            heads[f] = head[f]
        g_raw, g_row = records(blob, at.groups, counts["n_groups"], GROUP_DTYPE)
        f_raw, f_row = records(blob, at.flights, counts["n_flights"], FLIGHT_DTYPE)
        s_raw, s_row = records(blob, at.steps, counts["n_steps"], STEP_DTYPE)
        samples, sample_rows = records(blob, at.samples, counts["n_samples"], SAMPLE_DTYPE)
        p2p, p2p_rows = records(blob, p2p_at, n_p2p, P2P_DTYPE)
        groups = _columns(g_raw, g_row, _GROUPS)
        flights = _columns(f_raw, f_row, _FLIGHTS)
        steps = np.zeros(len(s_raw), _STEPS)
        steps["row"] = s_row
        steps["step"] = s_raw["step"]
        steps["start_ns"] = heads["time_ns"][s_row] + s_raw["rel_us"].astype(np.int64) * 1000
        steps["step_us"], steps["compute_us"] = s_raw["step_us"], s_raw["compute_us"]
        # the last figure: the host's compute in a summary of device time, else a CPU wait
        device = (heads["flags"][s_row] & FLAG_DEVICE_TIME) != 0
        steps["cpu_wait_us"] = np.where(device, 0, s_raw["aside_us"])
        steps["host_compute_us"] = np.where(device, s_raw["aside_us"], 0)
        spans = np.stack([channels_at - starts, p2p_at - starts], axis=1)
        table = cls(
            packed.ranks,
            heads,
            groups,
            flights,
            steps,
            samples,
            sample_rows,
            p2p,
            p2p_rows,
            (names, host_ids),
            packed,
            spans,
        )
        for i, why in table._problems(ok).items():
            bad[ranks[i]] = f"corrupt ccld summary of rank {int(heads['rank'][i])}: {why}"
            ok[i] = False
        return (table if ok.all() else table.select(ok)), bad

    @classmethod
    def of(cls, summaries: Mapping[int, RankSummary]) -> SummaryTable:
        """The table of summary objects (a post-mortem's, a test's): looked up, a rank
        gives its own object back."""
        ranks = sorted(summaries)
        objs = [summaries[r] for r in ranks]
        heads = np.zeros(len(objs), _HEADS)
        for f in (*_HEAD_FIELDS, "groups_version"):
            heads[f] = [getattr(s, f) for s in objs]
        groups = _rows(
            _GROUPS,
            ((i, *g[:3], g.ops, g.max_dur_us) for i, s in enumerate(objs) for g in s.groups),
        )
        flights = _rows(
            _FLIGHTS,
            (
                (i, o.slot, o.op, o.flags, o.peer, o.seq, o.enter_ns, o.state)
                for i, s in enumerate(objs)
                for o in s.in_flight
            ),
        )
        steps = _rows(_STEPS, ((i, *t) for i, s in enumerate(objs) for t in s.steps))
        samples, sample_rows = _object_rows([encoded_samples(s) for s in objs], SAMPLE_DTYPE)
        p2p, p2p_rows = _object_rows([encoded_p2p(s) for s in objs], P2P_DTYPE)
        spans = np.full((len(objs), 2), -1, np.int64)
        hosts = ([s.host for s in objs], np.arange(len(objs), dtype=np.int64))
        keys = np.array(ranks, np.int64)
        per_record = (groups, flights, steps, samples, sample_rows, p2p, p2p_rows)
        return cls(keys, heads, *per_record, hosts, objs, spans)

    def select(self, keep: np.ndarray) -> SummaryTable:
        """The table of the rows where ``keep`` (a bool per row) is set."""
        renumber = np.cumsum(keep) - 1

        def part(a: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            mine = keep[rows]
            return a[mine], renumber[rows[mine]]

        picked = np.flatnonzero(keep).tolist()
        values = self._values
        kept = (
            values.select(keep)
            if isinstance(values, PackedSummaries)
            else [values[i] for i in picked]
        )

        def records(a: np.ndarray) -> np.ndarray:
            a, rows = part(a, a["row"])
            a = a.copy()
            a["row"] = rows
            return a

        samples, sample_rows = part(self.samples, self.sample_rows)
        p2p, p2p_rows = part(self.p2p, self.p2p_rows)
        table = SummaryTable(
            self.ranks[keep],
            self.heads[keep],
            records(self.groups),
            records(self.flights),
            records(self.steps),
            samples,
            sample_rows,
            p2p,
            p2p_rows,
            (self.host_names, self.host_ids[keep]),
            kept,
            self._channel_spans[keep],
        )
        table._decoded = self._decoded  # the same rank, the same value: one object
        return table

    # ------------------------------------------------------------------ lookups
    def row_of(self, rank: int) -> int | None:
        if not isinstance(rank, int):
            return None
        n = len(self.ranks)
        if n and int(self.ranks[-1]) - int(self.ranks[0]) == n - 1:
            # ranks ascending, each once: consecutive ones (a round that heard from all)
            # are found by arithmetic, where a dict of 65,536 of them costs ~10 ms a round
            i = rank - int(self.ranks[0])
            return i if 0 <= i < n else None
        if self._index is None:
            self._index = {r: i for i, r in enumerate(self.ranks.tolist())}
        return self._index.get(rank)

    def __getitem__(self, rank: int) -> RankSummary:
        i = self.row_of(rank)
        if i is None:
            raise KeyError(rank)
        values = self._values
        if not isinstance(values, PackedSummaries):
            return values[i]
        s = self._decoded.get(rank)
        if s is None:
            value = values.at_row(i)
            s = self._decoded[rank] = read_summary(value)
            start, end = self._channel_spans[i].tolist()
            s.channels = value[start:end]
        return s

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and self.row_of(rank) is not None

    def __iter__(self) -> Iterator[int]:
        return iter(self.ranks.tolist())

    def __len__(self) -> int:
        return len(self.heads)

    def host(self, row: int) -> str:
        """The host name in the ``row``-th summary."""
        return self.host_names[self.host_ids[row]]

    def rows_on_hosts(self, accept: Callable[[str], bool]) -> np.ndarray:
        """Per row: whether ``accept`` takes its host name (asked once per distinct name)."""
        accepted = np.array([accept(h) for h in self.host_names], bool)
        return accepted[self.host_ids] if len(accepted) else np.zeros(len(self), bool)

    @property
    def exited(self) -> np.ndarray:
        """Per row: whether the rank left through the plugin's exit path."""
        return (self.heads["flags"] & FLAG_EXITED) != 0

    @property
    def left_cleanly(self) -> np.ndarray:
        """Per row: whether the rank left through the exit path, neither on an uncaught
        exception nor with an op of its raising."""
        failed = FLAG_ERRORED | FLAG_CRASHED
        return (self.heads["flags"] & (FLAG_EXITED | failed)) == FLAG_EXITED

    @property
    def crashed(self) -> np.ndarray:
        """Per row: whether the rank left on an uncaught exception that no op of its
        raised (one that did: a peer's failure may have reached it through the op)."""
        return (self.heads["flags"] & (FLAG_CRASHED | FLAG_ERRORED)) == FLAG_CRASHED

    @property
    def errored_crashes(self) -> np.ndarray:
        """Per row: whether the rank left on an uncaught exception after an op of its
        raised."""
        both = FLAG_CRASHED | FLAG_ERRORED
        return (self.heads["flags"] & both) == both

    def without_channels(self, ranks: set[int]) -> None:
        """Leave the channel evidence of ``ranks`` out (a value that names a peer outside
        the job), in the table's rows and in their summaries."""
        for r in ranks:
            i = self.row_of(r)
            if i is None:
                continue
            self._channel_spans[i] = (0, 0)
            self._decoded.pop(r, None)
            if not isinstance(self._values, PackedSummaries):
                self._values[i].channels = b""
        self._channel_rows = None

    def channel_rows(self) -> ChannelRows:
        """The channel evidence of every row (built once per table)."""
        if self._channel_rows is None:
            values = self._values
            if isinstance(values, PackedSummaries):
                spans = self._channel_spans
                self._channel_rows = channel_rows_at(
                    values.blob,
                    values.starts + spans[:, 0],
                    spans[:, 1] - spans[:, 0],
                    self.ranks,
                    self.heads["time_ns"],
                )
            else:
                self._channel_rows = channel_rows(values)
        return self._channel_rows

    # ------------------------------------------------------------------ checks
    def _problems(self, ok: np.ndarray) -> dict[int, str]:
        """Per row still ``ok``: what is impossible in it (``summary.problems``, the checks
        of the per-rank decoder)."""
        found = problems(
            self.heads,
            (self.groups["row"], self.groups["slot"]),
            (self.flights, self.flights["row"]),
            (self.steps, self.steps["row"]),
            (self.p2p, self.p2p_rows),
        )
        return {i: why for i, why in found.items() if ok[i]}


class Summaries(Sequence[RankSummary]):
    """The summaries of a table in rank order, as a sequence (each decoded when reached),
    with the table for code that reads the columns."""

    def __init__(self, table: SummaryTable) -> None:
        self.table = table
        self._ranks = table.ranks.tolist()

    def __len__(self) -> int:
        return len(self._ranks)

    def __getitem__(self, i: int) -> RankSummary:  # type: ignore[override]
        return self.table[self._ranks[i]]

    def __iter__(self) -> Iterator[RankSummary]:
        return (self.table[r] for r in self._ranks)


def table_of(summaries: Sequence[RankSummary]) -> SummaryTable:
    """The columns of ``summaries``: their table, or one made of the objects."""
    if isinstance(summaries, Summaries):
        return summaries.table
    return SummaryTable.of({s.rank: s for s in summaries})


def _object_rows(encoded: list[bytes], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Records encoded per summary object, as one array, and the row of each."""
    sizes = [len(e) // dtype.itemsize for e in encoded]
    return (
        np.frombuffer(b"".join(encoded), dtype),
        np.repeat(np.arange(len(encoded), dtype=np.int64), sizes),
    )


def _flagged(
    bad: dict[int, str], ranks: list[int], mask: np.ndarray, ok: np.ndarray, why: str
) -> np.ndarray:
    """Record ``why`` for the rows of ``mask`` still ``ok``; the rows not flagged."""
    for i in np.flatnonzero(mask & ok).tolist():
        bad[ranks[i]] = why
    return ~mask


def _hosts(
    blob: bytes, at: np.ndarray, length: np.ndarray
) -> tuple[list[str], np.ndarray, dict[int, str]]:
    """Host names of ``length`` bytes from ``at`` in ``blob``: the names of the runs of rows
    that repeat one (a node's ranks are consecutive rows), each row's run, and by row why
    its name does not decode (named ""). The runs' names are decoded in one call."""
    n, width = len(at), int(length.max(initial=0))
    if width == 0:
        return [""], np.zeros(n, np.int64), {}
    data = np.frombuffer(blob, np.uint8)
    column = np.arange(width)
    raw = np.where(
        column < length[:, None], data[np.minimum(at[:, None] + column, len(data) - 1)], 0
    ).astype(np.uint8)
    new = np.ones(n, bool)
    new[1:] = (length[1:] != length[:-1]) | (raw[1:] != raw[:-1]).any(axis=1)
    firsts = np.flatnonzero(new)
    run = np.cumsum(new) - 1
    names, failed = _names(raw[firsts], length[firsts])
    unreadable = {}
    if failed:
        for i in np.flatnonzero(np.isin(run, list(failed))).tolist():
            unreadable[i] = failed[int(run[i])]
    return names, run, unreadable


def _names(raw: np.ndarray, length: np.ndarray) -> tuple[list[str], dict[int, str]]:
    """The names in the rows of ``raw`` (``length`` bytes each), and by row why one does
    not decode: all joined by newlines and decoded at once (a newline byte is never part
    of a longer UTF-8 character); one by one where that fails or a name holds a newline."""
    line = np.column_stack([raw, np.full(len(raw), ord("\n"), np.uint8)])
    keep = np.column_stack([np.arange(raw.shape[1]) < length[:, None], np.ones(len(raw), bool)])
    try:
        names = line[keep].tobytes().decode().split("\n")[:-1]
        if len(names) == len(raw):
            return names, {}
    except UnicodeDecodeError:
        pass
    names, failed = [], {}
    for k, row in enumerate(raw.tolist()):
        try:
            names.append(bytes(row[: length[k]]).decode())
        except UnicodeDecodeError as exc:
            names.append("")
            failed[k] = str(exc)
    return names, failed


def _columns(raw: np.ndarray, rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    out = np.zeros(len(raw), dtype)
    out["row"] = rows
    assert dtype.names is not None
    for f in dtype.names[1:]:
        out[f] = raw[f]
    return out


def _rows(dtype: np.dtype, values: Iterator[tuple]) -> np.ndarray:
    items = list(values)
    return np.array(items, dtype) if items else np.zeros(0, dtype)
