"""The diagnoser's output: a verdict is a record, not a sentence."""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from enum import Enum
from numbers import Integral, Real
from pathlib import Path
from typing import Any

__all__ = [
    "MEASURES",
    "MEASURE_FIELDS",
    "RECORD_FIELDS",
    "SCHEMA_FILE",
    "VERDICT_SCHEMA_VERSION",
    "Cause",
    "Culprit",
    "Device",
    "Evidence",
    "Kind",
    "Verdict",
    "finding_id",
    "iso_time",
]

# 2: evidence items are {"fact", "text", "data"} (1: sentences only). 3: who and where
# (culprits with host, local rank and device; time, job, id, resumes), and the measure by
# its name (ratio, stuck_s, lasted_s) where 2 had one "severity" of a meaning per kind.
VERDICT_SCHEMA_VERSION = 3
# The JSON Schema of a record of this version (shipped in the package).
SCHEMA_FILE = Path(__file__).with_name("verdict.schema.json")


class Kind(str, Enum):
    HANG = "hang"
    SLOW = "slow"
    MISMATCH = "mismatch"
    UNRESPONSIVE = "unresponsive"
    DEADLOCK = "deadlock"
    CRASH = "crash"
    RESUMED = "resumed"  # a hang reported before ended: its ranks made progress again


class Cause(str, Enum):
    COMPUTE = "compute"
    COMMUNICATION = "communication"
    SOFTWARE = "software"
    UNKNOWN = "unknown"


# What a verdict's measure (``Verdict.severity``) is, by kind, and the record field it is
# written to: a straggler's or slow link's ratio to its reference, the seconds a stall had
# made no progress when it was found, and how long a stall that ended lasted.
MEASURES = {
    "slow": "ratio",
    "hang": "stuck_s",
    "deadlock": "stuck_s",
    "mismatch": "stuck_s",
    "unresponsive": "stuck_s",
    "resumed": "lasted_s",
}
MEASURE_FIELDS = ("ratio", "stuck_s", "lasted_s")


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


class _Sentence(string.Formatter):
    """``str.format`` with two more format specs that the evidence sentences need, so that
    a sentence is rendered from plain data: ``{n:bytes}`` (1.2 MB, 340.0 KB, 12 B) and
    ``{xs:join(SEP)}`` (a list's items joined by SEP)."""

    def format_field(self, value: Any, format_spec: str) -> str:
        if format_spec == "bytes":
            return _fmt_bytes(value)
        if format_spec.startswith("join(") and format_spec.endswith(")"):
            return format_spec[5:-1].join(map(str, value))
        return super().format_field(value, format_spec)


_SENTENCE = _Sentence()
_FIXED = re.compile(r"\.(\d+)([f%])$")


def _plain(x: Any) -> Any:
    """``x`` as JSON values (numpy scalars, tuples and mappings included)."""
    if x is None or isinstance(x, bool | str):
        return x
    if isinstance(x, Integral):
        return int(x)
    if isinstance(x, Real):
        return float(x)
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    raise TypeError(f"evidence data must be JSON values, not {type(x).__name__}")


def _as_shown(template: str, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each float rounded to the precision the template shows it at (the
    highest, if it shows it twice): the numbers say what the sentence says, no more."""
    digits: dict[str, int] = {}
    for _, name, spec, _ in _SENTENCE.parse(template):
        m = _FIXED.match(spec or "")
        if name and m and name in data:
            n = int(m[1]) + (2 if m[2] == "%" else 0)
            digits[name] = max(n, digits.get(name, n))
    out = dict(data)
    for name, n in digits.items():
        x = out[name]
        if isinstance(x, float):
            out[name] = round(x) if n == 0 else round(x, n)
    return out


@dataclass(frozen=True, slots=True)
class Evidence:
    """One fact behind a verdict: ``fact``, a stable snake_case name of what it says (one
    per kind of sentence; docs/reference/evidence-facts.md lists them with their data),
    ``data``, its numbers and ranks as JSON values, and ``text``, the sentence rendered
    from them."""

    fact: str
    data: Mapping[str, Any]
    text: str

    @classmethod
    def of(cls, fact: str, template: str, **data: Any) -> Evidence:
        """The fact with ``text = template.format(**data)`` (with the ``bytes`` and
        ``join(SEP)`` specs of :class:`_Sentence`); floats are kept at the precision the
        sentence shows them."""
        shown = _as_shown(template, _plain(data))
        return cls(fact, shown, _SENTENCE.format(template, **shown))

    def to_dict(self) -> dict[str, Any]:
        return {"fact": self.fact, "text": self.text, "data": _plain(self.data)}


@dataclass(frozen=True, slots=True)
class Device:
    """The accelerator a rank drives: its CUDA index and UUID (None where not known)."""

    index: int
    uuid: str | None = None


@dataclass(frozen=True, slots=True)
class Culprit:
    """Where a rank the verdict names runs: what an operator drains or restarts. None
    where the job did not say (a post-mortem's boards carry no local rank)."""

    rank: int
    host: str | None = None
    local_rank: int | None = None
    device: Device | None = None  # None on a CPU rank


def iso_time(when: datetime) -> str:
    """``when`` as ISO 8601 UTC to the millisecond: ``2026-12-07T20:05:23.123Z``."""
    utc = when.astimezone(timezone.utc).isoformat(timespec="milliseconds")
    return utc.replace("+00:00", "Z")


def finding_id(
    job: str,
    run: int,
    kind: str,
    cause: str,
    ranks: list[int],
    group_id: str | None,
    trace_id: str | None,
) -> str:
    """A finding's id: the same from any diagnoser of one run of the job (the standby that
    takes over computes the one the first diagnoser did), another for the next run
    (``run``: its start on the job's clock) and for another stall of the same ranks (at
    another op: ``trace_id``)."""
    what = json.dumps([job, run, kind, cause, ranks, group_id, trace_id])
    return hashlib.sha256(what.encode()).hexdigest()[:16]


@dataclass
class Verdict:
    kind: Kind
    cause: Cause
    ranks: list[int]
    group: dict | None  # {"role", "ranks", "group_id"}
    link: list[int] | None = None
    op: str | None = None
    trace_id: str | None = None  # "<group_id hex>:<seq>"
    step: int | None = None
    onset_s: float | None = None  # seconds since job start, diagnoser's clock
    detected_s: float | None = None
    severity: float | None = None
    evidence: list[Evidence] = field(default_factory=list)
    stack: list[str] | None = None
    # Who and where, filled in when the verdict is emitted (:meth:`stamp`).
    culprits: list[Culprit] = field(default_factory=list)
    time: str | None = None  # ISO 8601 UTC, when it was found
    job: str | None = None  # the launcher's job id (SLURM_JOB_ID, TORCHELASTIC_RUN_ID, name)
    id: str | None = None  # stable for one finding (finding_id)
    resumes: str | None = None  # a resumed verdict's: the id of the hang it ends

    def key(self) -> tuple:
        """What makes two verdicts the same finding (for de-duplication). A rank lost is
        one finding whatever op its summaries last showed it in."""
        return (
            self.kind,
            self.cause,
            tuple(self.ranks),
            self.group["group_id"] if self.group and self.kind is not Kind.UNRESPONSIVE else None,
        )

    def stamp(
        self,
        job: str | None,
        run: int,
        when: datetime | None,
        where: Callable[[int], Culprit] = Culprit,
    ) -> None:
        """Fill in who and where: the job and its run (its start on the job's clock), when
        the verdict was found (None where no wall clock is known: a replay), and where
        each of its ranks runs (``where``)."""
        group_id = self.group["group_id"] if self.group else None
        self.job, self.time = job, None if when is None else iso_time(when)

        def of(kind: Kind) -> str:
            return finding_id(
                job or "", run, kind.value, self.cause.value, self.ranks, group_id, self.trace_id
            )

        self.id = of(self.kind)
        if self.kind is Kind.RESUMED:  # the hang it ends was of the same ranks, group, op
            self.resumes = of(Kind.HANG)
        self.culprits = [where(r) for r in self.ranks]

    def to_dict(self) -> dict:
        d = asdict(self)
        measure = d.pop("severity")
        d["kind"], d["cause"] = self.kind.value, self.cause.value
        d["evidence"] = [e.to_dict() for e in self.evidence]
        d.update(dict.fromkeys(MEASURE_FIELDS))
        if self.kind.value in MEASURES:
            d[MEASURES[self.kind.value]] = measure
        d["schema"] = VERDICT_SCHEMA_VERSION
        return d


# The fields of a record (``Verdict.to_dict``), in order.
RECORD_FIELDS = [
    *(f.name for f in fields(Verdict) if f.name != "severity"),
    *MEASURE_FIELDS,
    "schema",
]
