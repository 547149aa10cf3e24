"""The diagnoser's output: a verdict is a record, not a sentence."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

__all__ = ["Cause", "Kind", "VERDICT_SCHEMA_VERSION", "Verdict"]

VERDICT_SCHEMA_VERSION = 1


class Kind(str, Enum):
    HANG = "hang"
    SLOW = "slow"
    MISMATCH = "mismatch"
    UNRESPONSIVE = "unresponsive"
    DEADLOCK = "deadlock"


class Cause(str, Enum):
    COMPUTE = "compute"
    COMMUNICATION = "communication"
    SOFTWARE = "software"
    UNKNOWN = "unknown"


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
    evidence: list[str] = field(default_factory=list)
    stack: list[str] | None = None

    def key(self) -> tuple:
        """What makes two verdicts the same finding (for de-duplication)."""
        return (
            self.kind,
            self.cause,
            tuple(self.ranks),
            self.group["group_id"] if self.group else None,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"], d["cause"] = self.kind.value, self.cause.value
        d["schema"] = VERDICT_SCHEMA_VERSION
        return d
