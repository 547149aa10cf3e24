"""The diagnoser's output: a verdict is a record, not a sentence."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from numbers import Integral, Real
from typing import Any

__all__ = ["Cause", "Evidence", "Kind", "VERDICT_SCHEMA_VERSION", "Verdict"]

# 2: evidence items are {"fact", "text", "data"} (1: sentences only)
VERDICT_SCHEMA_VERSION = 2


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

    def key(self) -> tuple:
        """What makes two verdicts the same finding (for de-duplication). A rank lost is
        one finding whatever op its summaries last showed it in."""
        return (
            self.kind,
            self.cause,
            tuple(self.ranks),
            self.group["group_id"] if self.group and self.kind is not Kind.UNRESPONSIVE else None,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"], d["cause"] = self.kind.value, self.cause.value
        d["evidence"] = [e.to_dict() for e in self.evidence]
        d["schema"] = VERDICT_SCHEMA_VERSION
        return d
