"""Verdicts files (JSON lines, one verdict record a line) as the post-mortem commands read
them (``trace --verdicts``) and append to them (``--jsonl``): a file that is not one is
refused in one line that names the path and the line, never half-read or mixed with."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import stat
from collections.abc import Iterable, Iterator
from numbers import Real
from pathlib import Path
from typing import Any, BinaryIO

from ccld_plugin.board.reader import MAX_TIME_NS
from ccld_plugin.diagnose.records import Cause, Kind
from ccld_plugin.files import FileError, one_line, open_regular, os_problem
from ccld_plugin.postmortem.boards import PostmortemError
from ccld_plugin.postmortem.outputs import check_folder, existing, open_append
from ccld_plugin.sinks.jsonl import upgraded

__all__ = ["append_verdicts", "check_verdicts_out", "read_verdict_file", "verdict_problem"]

MAX_LINE = 1 << 20  # bytes; a verdict with its stack and evidence is a few KB
_KINDS = {k.value for k in Kind}
_CAUSES = {c.value for c in Cause}
_MAX_S = MAX_TIME_NS / 1e9  # seconds since the job's start: onset and detection
WHAT = "a verdicts file (JSON lines)"


def verdict_problem(v: Any) -> str | None:
    """What makes ``v`` (a parsed JSON line) no verdict record, None if it is one: the
    fields the readers use, of their types and ranges (other fields are let through)."""
    if not isinstance(v, dict):
        return f"a JSON {type(v).__name__}, not an object"
    kind, cause = v.get("kind"), v.get("cause")
    if not (_name_in(kind, _KINDS) and _name_in(cause, _CAUSES)):
        return f"kind {_short(kind)}, cause {_short(cause)}"
    ranks = v.get("ranks")
    if not isinstance(ranks, list) or not all(_int_in(r, 0, 2**31 - 1) for r in ranks):
        return f"ranks {_short(ranks)}"
    group = v.get("group")
    if group is not None and not (isinstance(group, dict) and _hex_id(group.get("group_id"))):
        return f"group {_short(group)}"
    for key in ("onset_s", "detected_s"):
        t = v.get(key)
        if t is not None and not (_real(t) and abs(t) <= _MAX_S):
            return f"{key} {_short(t)}"
    for key in ("op", "trace_id"):
        if not isinstance(v.get(key), (str, type(None))):
            return f"{key} {_short(v.get(key))}"
    evidence = v.get("evidence", [])
    schema = v.get("schema", 1)
    if not _int_in(schema, 1, 2**31 - 1):
        return f"schema {_short(schema)}"
    if not isinstance(evidence, list) or not all(
        isinstance(e, str) if schema < 2 else isinstance(e, dict) and isinstance(e.get("text"), str)
        for e in evidence
    ):
        return f"evidence {_short(evidence)} (schema {schema})"
    return None


def read_verdict_file(path: Path) -> tuple[list[dict], str | None]:
    """The verdict records of ``path``, and a line that says which lines were left out as
    no verdict records (None: none was). A file whose first record is not one is refused;
    a torn last line (its writer died) is left out unsaid. Records of older schemas are
    read in the current shape (``sinks.jsonl.upgraded``)."""
    try:
        fd = open_regular(path, WHAT)
    except FileError as exc:
        raise PostmortemError(str(exc)) from None
    records: list[dict] = []
    left_out: list[str] = []
    try:
        with os.fdopen(fd, "rb") as f:
            for n, raw in _lines(f):
                record, problem = _record(raw)
                if problem is not None and not records and not left_out:
                    raise PostmortemError(f"{path}:{n}: {problem}; expected {WHAT}")
                if problem is not None:
                    left_out.append(f"line {n}: {problem}")
                elif record is not None:
                    records.append(record)
    except OSError as exc:
        raise PostmortemError(os_problem(path, exc)) from None
    if not left_out:
        return records, None
    return records, one_line(
        f"{path}: {len(left_out)} line(s) left out as no verdict records (the first, "
        f"{left_out[0]}); the others are read"
    )


def _lines(f: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """The lines of ``f`` (numbered from 1), each cut to MAX_LINE + 1 bytes (a longer one
    is no verdict record); a torn last one (no end of line) is left out."""
    for n in itertools.count(1):
        raw = rest = f.readline(MAX_LINE + 1)
        while rest and not rest.endswith(b"\n"):  # the rest of a long line
            rest = f.readline(MAX_LINE)
        if not rest:
            return  # the end: nothing, or a torn last line
        yield n, raw


def _record(raw: bytes) -> tuple[dict | None, str | None]:
    """A line as a verdict record, or what it is instead; (None, None) for a blank line."""
    if len(raw) > MAX_LINE:
        return None, f"a line longer than {MAX_LINE} bytes"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {raw[exc.start]:#04x})"
    if not text.strip():
        return None, None
    try:
        v = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deep"
        return None, f"not a JSON line ({why})"
    problem = verdict_problem(v)
    if problem is not None:
        return None, f"not a verdict record ({problem})"
    return upgraded(v), None


def check_verdicts_out(path: Path, force: bool) -> None:
    """Refuse ``path`` as a ``--jsonl`` file before the analysis runs: see
    :func:`append_verdicts`."""
    check_folder(path)
    if existing(path) is not None and not force:
        _torn_at_end(path)


def append_verdicts(path: Path, records: Iterable[dict], force: bool) -> None:
    """Append ``records`` to the verdicts file ``path`` (created if missing, in a folder
    that exists), one JSON line each, flushed to disk. An existing file must be a regular
    file whose first line is a verdict record (or empty), unless ``force``."""
    new = existing(path) is None
    torn = not force and not new and _torn_at_end(path)
    fd = open_append(path, force)
    lines = [json.dumps(r).encode() + b"\n" for r in records]
    try:
        with os.fdopen(fd, "ab") as f:
            # after a torn last line (its writer died), the records start a line of their own
            f.write(b"".join([b"\n"] * torn + lines))
            f.flush()
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # (a pipe or device has no disk)
                os.fsync(f.fileno())
    except OSError as exc:
        if new:  # not left behind empty (a full disk)
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise PostmortemError(os_problem(path, exc, "written")) from None


def _torn_at_end(path: Path) -> bool:
    """Refuse an existing ``path`` that is not a verdicts file (not a regular file, or its
    first line not a verdict record); whether its last line is torn (no end of line)."""
    try:
        fd = open_regular(path, f"{WHAT}; give another path, or pass --force to write to it")
    except FileError as exc:
        raise PostmortemError(str(exc)) from None
    try:
        with os.fdopen(fd, "rb") as f:
            first = f.readline(MAX_LINE + 1)
            size = os.fstat(f.fileno()).st_size
            last = os.pread(f.fileno(), 1, size - 1) if size else b"\n"
    except OSError as exc:
        raise PostmortemError(os_problem(path, exc)) from None
    torn = not first.endswith(b"\n") and len(first) <= MAX_LINE  # its writer died
    problem = None if torn else _record(first)[1]
    if problem is not None:
        raise PostmortemError(
            f"{path}:1: {problem}; expected {WHAT}: give another path, or pass --force to "
            "append to it"
        )
    return last != b"\n"


def _name_in(x: Any, names: set[str]) -> bool:
    return isinstance(x, str) and x in names  # (a list is no set member: it is unhashable)


def _int_in(x: Any, low: int, high: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _real(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _hex_id(x: Any) -> bool:
    """A group id as records write it: up to 16 hex digits."""
    try:
        return isinstance(x, str) and 0 < len(x) <= 16 and int(x, 16) >= 0
    except ValueError:
        return False


def _short(x: Any) -> str:
    """``x`` for a message: its JSON, cut to 40 characters."""
    text = json.dumps(x)
    return text if len(text) <= 40 else text[:37] + "..."
