"""A recording of the live diagnoser's input, round by round: every rank's summary bytes as
the round took them, the group tables when they change, and the round's clock. Replayed
(``ccld replay FILE``) it drives a fresh analyzer through the same rounds, so that a job's
diagnosis can be looked at again, or with another config or version, without the job."""

from __future__ import annotations

import itertools
import os
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO

from ccld_plugin.files import FileError, OneLineError, open_private, open_regular, os_problem
from ccld_plugin.topology import GROUP_ROLES, GroupInfo
from ccld_plugin.wire.summary import upgraded_summary

__all__ = ["RecordedRound", "RecordingError", "RoundRecorder", "read_recording"]

FORMAT = "ccld-rounds/1"


@dataclass
class RecordedRound:
    now_ns: int
    job_start_ns: int
    world: int
    values: Mapping[int, bytes]  # every rank's summary as the round decoded it
    tables: dict[int, list[GroupInfo]]
    gone: set[int] = field(default_factory=set)
    observer: int | None = None
    store_local: bool = False
    store_failed: str | None = None
    observer_load: float = 0.0
    observer_round_ns: tuple[int, int] | None = None  # (absent in older recordings)
    reach: dict[int, bool] = field(default_factory=dict)  # (absent in older recordings)


class RoundRecorder:
    """Appends rounds to a file, as pickles of plain values only (read back by an
    unpickler that loads no class: a recording cannot run code). Each round's frame holds
    the summaries that changed since the round before, and the tables when they changed."""

    def __init__(self, path: Path, config_yaml: str) -> None:
        # Appended to: a standby that takes diagnosis over goes on in the same file.
        self._file: BinaryIO = open(open_private(path, append=True), "ab")  # noqa: SIM115 - open for the job's life
        pickle.dump({"format": FORMAT, "config": config_yaml}, self._file)
        self._values: dict[int, bytes] = {}
        self._tables: dict[int, list[GroupInfo]] | None = None

    def write(self, r: RecordedRound) -> None:
        frame: dict[str, Any] = {
            k: v for k, v in r.__dict__.items() if k not in ("tables", "values", "gone")
        }
        frame["values"] = {k: v for k, v in r.values.items() if self._values.get(k) != v}
        frame["gone"] = sorted(r.gone)
        if r.tables is not self._tables:
            frame["tables"] = {
                rank: [(g.group_id, g.role, tuple(g.ranks)) for g in groups]
                for rank, groups in r.tables.items()
            }
        self._values, self._tables = dict(r.values), r.tables
        pickle.dump(frame, self._file, protocol=pickle.HIGHEST_PROTOCOL)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class RecordingError(OneLineError):
    """A file that is not a round recording, or a round of one that is not as recorded;
    the message is one line that names the file."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a round recording holds no {module}.{name}")


def read_recording(path: Path) -> tuple[str, Iterator[RecordedRound]]:
    """The config (YAML) the recording diagnoser ran with, and its rounds, each with every
    rank's summary and the tables. A round that is not as recorded raises
    :class:`RecordingError` when it is reached; a last round cut short (the diagnoser
    ended while writing it) ends the rounds."""
    with _open(path) as f:
        try:
            head = _load(_ToTheEnd(f))
        except OSError as exc:
            raise RecordingError(os_problem(path, exc)) from None
        except Exception as exc:  # noqa: BLE001 - whatever the unpickler makes of bad bytes
            why = str(exc) or type(exc).__name__
            raise RecordingError(f"{path}: not a ccld round recording ({why})") from None
        start = f.tell()
    if (
        not isinstance(head, dict)
        or head.get("format") != FORMAT
        or not isinstance(head.get("config"), str)
    ):
        raise RecordingError(f"{path}: not a ccld round recording ({FORMAT})")
    # the rounds open the file again when first read: a caller that never reads them
    # (its config refused) holds no open file
    return head["config"], _rounds(path, start)


def _open(path: Path) -> BinaryIO:
    try:
        fd = open_regular(path, "a round recording (diagnoser.record)")
    except FileError as exc:
        raise RecordingError(str(exc)) from None
    return os.fdopen(fd, "rb")


class _ToTheEnd:
    """``f`` as an unpickler reads it, never asked for more than is left in the file: a
    length that no recorder writes (a flipped bit) is a frame cut short, not a read of
    exabytes. (No ``readinto``: the unpickler then reads with ``read``.)"""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._left = os.fstat(f.fileno()).st_size - f.tell()

    def read(self, n: int = -1) -> bytes:
        return self._took(self._f.read(self._left if n < 0 else min(n, self._left)))

    def readline(self, n: int = -1) -> bytes:
        return self._took(self._f.readline(self._left if n < 0 else min(n, self._left)))

    def _took(self, data: bytes) -> bytes:
        self._left -= len(data)
        return data


def _load(f: _ToTheEnd) -> Any:
    """The next frame (an unpickler per frame: each was pickled on its own)."""
    return _PlainUnpickler(f).load()


def _rounds(path: Path, start: int) -> Iterator[RecordedRound]:
    values: dict[int, bytes] = {}
    tables: dict[int, list[GroupInfo]] = {}
    with _open(path) as f:
        f.seek(start)
        frames = _ToTheEnd(f)
        for n in itertools.count(1):
            try:
                frame = _load(frames)
            except (EOFError, pickle.UnpicklingError, ValueError):  # the end, or cut short
                return
            except OSError as exc:
                raise RecordingError(os_problem(path, exc)) from None
            except Exception as exc:  # noqa: BLE001 - whatever the unpickler makes of bad bytes
                why = str(exc) or type(exc).__name__
                raise RecordingError(f"{path}: round {n} cannot be read ({why})") from None
            if isinstance(frame, dict) and "format" in frame:
                continue  # a diagnoser that took over goes on from here
            problem = _frame_problem(frame)
            if problem is not None:
                raise RecordingError(f"{path}: round {n} is not as recorded ({problem})")
            if "tables" in frame:
                known: dict[tuple, GroupInfo] = {}
                tables = {
                    rank: [known.setdefault(t, GroupInfo(*t)) for t in groups]
                    for rank, groups in frame.pop("tables").items()
                }
            # (recorded by an earlier version: in this one's encoding)
            values = {**values, **{k: upgraded_summary(v) for k, v in frame.pop("values").items()}}
            frame["gone"] = set(frame["gone"])
            yield RecordedRound(values=values, tables=tables, **frame)


# A recorded time: on the diagnoser's monotonic clock, at most the board reader's bound
# (36 years), so that differences of two stay within 64 bits.
_MAX_NS = 1 << 60
_MAX_RANK = 2**31 - 1
_FIELDS = {f.name for f in fields(RecordedRound)}
_OPTIONAL = {"observer", "store_local", "store_failed", "observer_load"}
_OPTIONAL |= {"observer_round_ns", "reach", "tables"}


def _frame_problem(frame: Any) -> str | None:
    """What makes ``frame`` no round as :class:`RoundRecorder` writes them (None: it is
    one): its keys, and each value of its type and range."""
    if not isinstance(frame, dict):
        return f"a {type(frame).__name__}, not a round"
    missing, unknown = _FIELDS - _OPTIONAL - set(frame), set(frame) - _FIELDS
    if missing or unknown:
        return f"fields missing {sorted(missing)}, unknown {sorted(map(str, unknown))}"
    checks = {
        "now_ns": _int_in(frame["now_ns"], 0, _MAX_NS),
        "job_start_ns": _int_in(frame["job_start_ns"], 0, _MAX_NS),
        "world": _int_in(frame["world"], 1, _MAX_RANK),
        "values": _by_rank(frame["values"], lambda v: isinstance(v, bytes)),
        "gone": isinstance(frame["gone"], list) and all(map(_rank, frame["gone"])),
        "observer": frame.get("observer") is None or _rank(frame["observer"]),
        "store_local": isinstance(frame.get("store_local", False), bool),
        "store_failed": isinstance(frame.get("store_failed"), (str, type(None))),
        "observer_load": _fraction(frame.get("observer_load", 0.0)),
        "observer_round_ns": _round_ns(frame.get("observer_round_ns")),
        "reach": _by_rank(frame.get("reach", {}), lambda ok: isinstance(ok, bool)),
        "tables": "tables" not in frame or _tables_ok(frame["tables"]),
    }
    bad = [name for name, ok in checks.items() if not ok]
    return f"{', '.join(bad)} out of range or of another type" if bad else None


def _int_in(x: Any, low: int, high: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _rank(x: Any) -> bool:
    return _int_in(x, 0, _MAX_RANK)


def _by_rank(x: Any, value_ok: Callable[[Any], bool]) -> bool:
    """A dict by rank whose values pass ``value_ok``."""
    return isinstance(x, dict) and all(_rank(r) and value_ok(v) for r, v in x.items())


def _fraction(x: Any) -> bool:
    return isinstance(x, float | int) and not isinstance(x, bool) and 0 <= x <= 1


def _round_ns(x: Any) -> bool:
    return x is None or (
        isinstance(x, tuple) and len(x) == 2 and all(_int_in(t, 0, _MAX_NS) for t in x)
    )


def _tables_ok(tables: Any) -> bool:
    """Per rank, its groups as (group id, role, ranks)."""
    return _by_rank(
        tables,
        lambda groups: (
            isinstance(groups, list)
            and all(
                isinstance(g, tuple)
                and len(g) == 3
                and _int_in(g[0], 0, 2**64 - 1)
                and g[1] in GROUP_ROLES
                and isinstance(g[2], tuple)
                and all(map(_rank, g[2]))
                for g in groups
            )
        ),
    )
