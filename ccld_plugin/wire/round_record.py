"""A recording of the live diagnoser's input, round by round: every rank's summary bytes as
the round took them, the group tables when they change, and the round's clock. Replayed
(``ccld replay FILE``) it drives a fresh analyzer through the same rounds, so that a job's
diagnosis can be looked at again, or with another config or version, without the job."""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ccld_plugin.private_files import open_private
from ccld_plugin.wire.summary import upgraded_summary
from ccld_plugin.wire.topology import GroupInfo

__all__ = ["RecordedRound", "RoundRecorder", "read_recording"]

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


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a round recording holds no {module}.{name}")


def read_recording(path: Path) -> tuple[str, Iterator[RecordedRound]]:
    """The config (YAML) the recording diagnoser ran with, and its rounds, each with every
    rank's summary and the tables."""
    f = open(path, "rb")  # noqa: SIM115 - closed when the rounds are read
    try:
        head = _load(f)
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        f.close()
        raise ValueError(f"{path}: not a ccld round recording ({exc})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        f.close()
        raise ValueError(f"{path}: not a ccld round recording ({FORMAT})")
    return str(head["config"]), _rounds(f)


def _load(f: BinaryIO) -> Any:
    """The next frame (an unpickler per frame: each was pickled on its own)."""
    return _PlainUnpickler(f).load()


def _rounds(f: BinaryIO) -> Iterator[RecordedRound]:
    values: dict[int, bytes] = {}
    tables: dict[int, list[GroupInfo]] = {}
    with f:
        while True:
            try:
                frame = _load(f)
            except (EOFError, pickle.UnpicklingError):  # the end, or a frame cut short
                return
            if "format" in frame:  # a diagnoser that took over goes on from here
                continue
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
