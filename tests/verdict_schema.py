"""The JSON Schema of verdict records that ships in the package, as the tests check every
verdicts file they leave behind against it (``conftest.verdicts_follow_the_schema``)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import jsonschema

from ccld_plugin.diagnose.records import SCHEMA_FILE, VERDICT_SCHEMA_VERSION

VERDICT_SCHEMA = jsonschema.Draft202012Validator(
    json.loads(SCHEMA_FILE.read_text()), format_checker=jsonschema.FormatChecker()
)


def schema_problems(path: Path) -> list[str]:
    """Where the verdict records of the current schema in the JSON lines file ``path``
    break the JSON Schema that ships in the package (older schemas' records, lines that
    are no records, which tests write on purpose, are the readers' tests' business)."""
    out = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # no record: a test's own bad line
            continue
        if isinstance(record, dict) and record.get("schema") == VERDICT_SCHEMA_VERSION:
            out += [f"{path}:{n}: {e.message}" for e in VERDICT_SCHEMA.iter_errors(record)]
    return out


def verdict_files(folder: Path) -> list[Path]:
    """The JSON lines files under ``folder``: regular files, not links (tests plant FIFOs
    and links to /dev/zero as verdicts files), of a size to read."""
    return [f for f in sorted(folder.rglob("*.jsonl")) if _regular(f)]


def _regular(path: Path) -> bool:
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size < 64 << 20
