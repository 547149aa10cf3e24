"""What an offline W&B run holds, read from its ``.wandb`` file alone (``ccld wandb-summary``).

The file is wandb's transaction log, in LevelDB's log format: a 7-byte header (``:W&B``,
magic 0xBEE1, version 0), then 32 KiB blocks of chunks. A chunk is a CRC-32 (IEEE, seeded
with the chunk's type byte), a 16-bit length, a type (full, first, middle, last) and the
data; a record too long for the rest of a block is split into first / middle / last
chunks, and a block tail shorter than a chunk header is zero padding. Each record is a
protobuf ``wandb_internal_pb2.Record``. Table rows are not in it: a history or summary
value of type ``table-file`` names a JSON file under the run's ``files/`` directory.

wandb buffers this file until its run finishes, so a run still being written (or whose
writer was killed) shows fewer records and no exit record: :func:`wait_for_run` waits for
one to finish.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RunContents",
    "RunFileError",
    "TableInfo",
    "find_run_files",
    "iter_records",
    "print_summary",
    "read_run",
    "wait_for_run",
]

HEADER = struct.Struct("<4sHB")
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
BLOCK = 32 * 1024
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_SEED = {t: zlib.crc32(bytes([t])) for t in (FULL, FIRST, MIDDLE, LAST)}
_INTERNAL = ("_step", "_runtime", "_timestamp", "_wandb")


class RunFileError(ValueError):
    """Not a .wandb file, or one of a version this reader does not know."""


def iter_records(path: Path) -> Iterator[bytes]:
    """The raw records of a .wandb file, in order. Stops quietly at a torn tail (the file
    of a run still being written ends mid-block); raises on a bad header or checksum."""
    data = Path(path).read_bytes()
    if len(data) < HEADER.size:
        raise RunFileError(f"{path}: too short for a .wandb header")
    ident, magic, version = HEADER.unpack_from(data)
    if ident != IDENT or magic != MAGIC:
        raise RunFileError(f"{path}: not a .wandb file (header {data[: HEADER.size]!r})")
    if version != VERSION:
        raise RunFileError(f"{path}: .wandb version {version}, this reader knows {VERSION}")
    pos, parts = HEADER.size, None  # the header counts towards the first block
    while True:
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:
            pos += left  # block trailer: zero padding
            continue
        if pos + CHUNK.size > len(data):
            return
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # unused rest of a block
            pos += left
            continue
        body = data[pos + CHUNK.size : pos + CHUNK.size + length]
        if len(body) < length or kind not in _SEED:
            return
        if zlib.crc32(body, _SEED[kind]) & 0xFFFFFFFF != crc:
            raise RunFileError(f"{path}: checksum mismatch in the chunk at byte {pos}")
        pos += CHUNK.size + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = [body]
        elif kind == MIDDLE and parts is not None:
            parts.append(body)
        elif kind == LAST and parts is not None:
            parts.append(body)
            yield b"".join(parts)
            parts = None


@dataclass
class TableInfo:
    key: str
    columns: list[str]
    rows: list[list]
    logged: int  # history rows with a table under this key (the last is shown); 0: summary
    path: str | None


@dataclass
class RunContents:
    file: Path
    run_id: str = ""
    project: str = ""
    name: str = ""
    records: int = 0
    points: dict[str, int] = field(default_factory=dict)  # history key -> rows holding it
    last: dict[str, Any] = field(default_factory=dict)  # history key -> last value
    values: dict[str, list] = field(default_factory=dict)  # history key -> scalar values
    summary: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, TableInfo] = field(default_factory=dict)
    charts: dict[str, str] = field(default_factory=dict)  # custom chart key -> its preset
    alerts: list[dict] = field(default_factory=list)
    finished: bool = False
    exit_code: int | None = None

    @property
    def run_dir(self) -> Path:
        return self.file.parent

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self.points if k.startswith(prefix))

    def to_dict(self) -> dict:
        return {
            "file": str(self.file),
            "run_id": self.run_id,
            "project": self.project,
            "name": self.name,
            "records": self.records,
            "finished": self.finished,
            "exit_code": self.exit_code,
            "points": dict(sorted(self.points.items())),
            "tables": {
                k: {"columns": t.columns, "rows": len(t.rows), "logged": t.logged}
                for k, t in sorted(self.tables.items())
            },
            "charts": dict(sorted(self.charts.items())),
            "alerts": self.alerts,
        }


def _items(items: Any) -> dict[str, Any]:
    """History / summary items as {top-level key: value}, nested keys folded back in."""
    out: dict[str, Any] = {}
    for it in items:
        path = list(it.nested_key) or [it.key]
        try:
            value = json.loads(it.value_json)
        except ValueError:
            value = it.value_json
        if len(path) == 1:
            out[path[0]] = value
            continue
        node = out.setdefault(path[0], {})
        if not isinstance(node, dict):
            node = out[path[0]] = {}
        for p in path[1:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = value
    return out


def _load_table(run_dir: Path, value: dict) -> tuple[list[str], list[list]]:
    path = value.get("path")
    if not path:
        return [], []
    try:
        doc = json.loads((run_dir / "files" / path).read_text())
    except (OSError, ValueError):
        return [], []
    return list(doc.get("columns", [])), list(doc.get("data", []))


def _is_table(v: Any) -> bool:
    return isinstance(v, dict) and v.get("_type") in ("table-file", "table")


def read_run(path: Path) -> RunContents:
    """Everything this module knows how to show about one run (a .wandb file)."""
    from wandb.proto import wandb_internal_pb2 as pb  # the record schema ships with wandb

    path = Path(path)
    out = RunContents(file=path)
    table_values: dict[str, dict] = {}  # the last table value under each key
    table_logs: dict[str, int] = {}  # history rows holding one
    for raw in iter_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        out.records += 1
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.run_id, out.project = rec.run.run_id, rec.run.project
            out.name = rec.run.display_name or out.name
        elif kind == "history":
            for k, v in _items(rec.history.item).items():
                if k.startswith(_INTERNAL):
                    continue
                out.points[k] = out.points.get(k, 0) + 1
                out.last[k] = v
                if isinstance(v, (int, float, str, bool)):
                    out.values.setdefault(k, []).append(v)
                if _is_table(v):
                    table_values[k] = v
                    table_logs[k] = table_logs.get(k, 0) + 1
        elif kind == "summary":
            for k, v in _items(rec.summary.update).items():
                if not k.startswith(_INTERNAL):
                    out.summary[k] = v
                    if _is_table(v) and k not in table_logs:
                        table_values[k] = v  # a table set only in the summary
        elif kind == "config":
            for k, v in _items(rec.config.update).items():
                if k == "_wandb" and isinstance(v, dict):
                    for chart, spec in (v.get("visualize") or {}).items():
                        cfg = spec.get("panel_config", {}) if isinstance(spec, dict) else {}
                        out.charts[chart] = cfg.get("panelDefId", "?")
        elif kind == "alert":
            out.alerts.append(
                {"title": rec.alert.title, "text": rec.alert.text, "level": rec.alert.level}
            )
        elif kind == "exit":
            out.finished, out.exit_code = True, rec.exit.exit_code
    for k, v in table_values.items():
        cols, rows = _load_table(out.run_dir, v)
        out.tables[k] = TableInfo(k, cols, rows, table_logs.get(k, 0), v.get("path"))
    return out


def find_run_files(root: Path) -> list[Path]:
    """The .wandb files at or under ``root`` (a run file, a run directory, a wandb
    directory or any directory above them), oldest first."""
    root = Path(root)
    if root.is_file():
        return [root]
    if not root.is_dir():
        return []
    # wandb's latest-run is a link to a run directory: count each file once.
    files = {p.resolve() for p in root.rglob("run-*.wandb")}
    return sorted(files, key=lambda p: p.stat().st_mtime)


def wait_for_run(root: Path, timeout_s: float, since: float = 0.0) -> RunContents | None:
    """The newest run under ``root`` (modified after ``since``, a time.time()), once it
    has finished or the timeout has passed; None if there is no such run file."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = [f for f in find_run_files(root) if f.stat().st_mtime >= since]
        contents = None
        if files:
            try:
                contents = read_run(files[-1])
            except RunFileError:
                contents = None
        if (contents is not None and contents.finished) or time.monotonic() > deadline:
            return contents
        time.sleep(0.5)


def print_summary(c: RunContents, console: Any = None, prefix: str = "") -> None:
    """A readable account of a run: its keys with their number of points, its tables,
    charts and alerts."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    state = (
        f"finished (exit code {c.exit_code})"
        if c.finished
        else "not finished (still being written, or its writer was killed)"
    )
    console.print(
        f"[bold]W&B run[/] {c.run_id} ({c.name or 'unnamed'}), project "
        f"{c.project!r}: {c.records} records, {state}\n  {c.file}"
    )
    keys = Table("key", "points", "last", title="history keys", title_justify="left")
    for k in c.keys(prefix):
        v = c.last.get(k)
        shown = v.get("_type", "object") if isinstance(v, dict) else v
        if isinstance(shown, float):
            shown = f"{shown:.4g}"
        keys.add_row(k, str(c.points[k]), str(shown))
    console.print(keys)
    if c.tables:
        tables = Table(
            "table", "rows", "times logged", "columns", title="tables", title_justify="left"
        )
        for k, t in sorted(c.tables.items()):
            if k.startswith(prefix):
                tables.add_row(k, str(len(t.rows)), str(t.logged), ", ".join(t.columns))
        console.print(tables)
    if c.charts:
        console.print(
            "[bold]custom charts[/]: "
            + ", ".join(f"{k} ({v})" for k, v in sorted(c.charts.items()))
        )
    console.print(f"[bold]alerts[/]: {len(c.alerts)}")
    for a in c.alerts:
        console.print(f"  [{a['level']}] {a['title']}")
        for line in a["text"].splitlines()[:4]:
            console.print(f"      {line}", style="dim")
    if c.finished is False:
        console.print(
            "[dim]wandb writes this file out when the run finishes; "
            "records of an unfinished run may be missing[/]"
        )
    console.print(f"[dim]upload it with: wandb sync {c.run_dir.resolve()}[/]")
