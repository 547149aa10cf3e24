"""Fault specs: ``KIND@RANK[:key=value[,key=value...]]``.

Kinds and their parameters:

- ``compute-slow@R:factor=F[,step=S]``: rank R's compute takes F times as long;
- ``compute-hang@R[:step=S]``: rank R blocks in compute before its next collective;
- ``mismatch@R[:step=S]``: rank R issues a different collective than its peers;
- ``comm-slow@R:rate=RATE[,step=S]``: rank R's link is shaped to RATE (e.g. ``20mbit``);
  with ``peer=P``, only the traffic between R and P (one connection; R's other links
  stay as they were);
- ``comm-hang@R[:step=S]``: rank R's link is cut;
- a comm fault with ``after_s=T`` starts T seconds after rank R reaches step S (mid-step:
  e.g. while its peers already wait in a collective for it);
- ``kill@R[:step=S]``: rank R's process ends itself with SIGKILL (no exit path runs);
- ``crash@R[:step=S]``: rank R's training code raises an exception it does not catch (an
  out-of-memory error, a bug): the process leaves through Python's exit path;
- ``freeze@R[:step=S]``: rank R's process stops itself (SIGSTOP): alive, its connections
  open, every thread of it frozen;
- ``cpu-contention@R[:step=S]``: another process takes rank R's CPU (a noisy neighbour):
  a busy process shares the one core its process is pinned to;
- ``device-slow@R:factor=F[,step=S]`` (on the simulated device): rank R's kernels take F
  times as long; its host is not slowed;
- ``device-hang@R[:step=S]`` (on the simulated device): a kernel on rank R never finishes.

``step`` is when the fault starts (default 3, after warm-up).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FAULT_KINDS", "FaultSpec", "FaultSpecError", "parse_fault", "parse_faults"]

DEFAULT_STEP = 3
FAULT_KINDS: dict[str, tuple[set[str], set[str]]] = {
    # kind: (required keys, optional keys)
    "compute-slow": ({"factor"}, {"step"}),
    "compute-hang": (set(), {"step"}),
    "mismatch": (set(), {"step"}),
    "comm-slow": ({"rate"}, {"step", "peer", "after_s"}),
    "comm-hang": (set(), {"step", "after_s"}),
    "kill": (set(), {"step"}),
    "crash": (set(), {"step"}),
    "freeze": (set(), {"step"}),
    "cpu-contention": (set(), {"step"}),
    "device-slow": ({"factor"}, {"step"}),
    "device-hang": (set(), {"step"}),
}
# ASCII digits only: str.isdigit and int() also take other scripts' digits (and "1_000")
_INT = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")
_RATE = re.compile(r"[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)")
_FORM = "KIND@RANK[:key=value,...], e.g. compute-hang@2:step=5"


class FaultSpecError(ValueError):
    """A malformed fault spec; the message is one line and shows the expected form."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: str
    rank: int
    step: int = DEFAULT_STEP
    factor: float = 1.0
    rate: str = ""
    peer: int | None = None  # comm-slow: shape only the traffic between rank and peer
    after_s: float = 0.0  # comm faults: seconds after the rank reaches ``step``

    @property
    def is_comm(self) -> bool:
        return self.kind.startswith("comm-")

    @property
    def is_device(self) -> bool:
        """A fault of the simulated device (its kernels), not of the host."""
        return self.kind.startswith("device-")

    def __str__(self) -> str:
        """The spec in its canonical form: it parses back to this fault."""
        short = f"{self.factor:g}"
        factor = short if float(short) == self.factor else repr(self.factor)
        peer = f"peer={self.peer}," if self.peer is not None else ""
        extra = {
            "compute-slow": f"factor={factor},",
            "device-slow": f"factor={factor},",
            "comm-slow": f"rate={self.rate},{peer}",
        }
        after = f",after_s={self.after_s:g}" if self.after_s else ""
        return f"{self.kind}@{self.rank}:{extra.get(self.kind, '')}step={self.step}{after}"


def parse_fault(text: str) -> FaultSpec:
    spec = text.strip()
    head, _, params = spec.partition(":")
    kind, at, rank_s = head.partition("@")
    if kind not in FAULT_KINDS:
        raise FaultSpecError(
            f"fault {spec!r}: unknown kind {kind!r}; known: "
            f"{', '.join(FAULT_KINDS)} (form: {_FORM})"
        )
    if not at or not _INT.fullmatch(rank_s):
        raise FaultSpecError(f"fault {spec!r}: needs a rank after '@' (form: {_FORM})")
    values: dict[str, str] = {}
    for item in filter(None, params.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise FaultSpecError(f"fault {spec!r}: {item!r} must be key=value (form: {_FORM})")
        if key.strip() in values:
            raise FaultSpecError(f"fault {spec!r}: {key.strip()!r} is given twice")
        values[key.strip()] = value.strip()
    required, optional = FAULT_KINDS[kind]
    unknown = set(values) - required - optional
    if unknown:
        raise FaultSpecError(
            f"fault {spec!r}: unknown parameter {sorted(unknown)[0]!r}; "
            f"{kind} takes {', '.join(sorted(required | optional))}"
        )
    missing = required - set(values)
    if missing:
        raise FaultSpecError(f"fault {spec!r}: {kind} needs {sorted(missing)[0]}=...")
    step_s, factor_s = values.get("step", str(DEFAULT_STEP)), values.get("factor", "1")
    if step_s.startswith("-"):
        raise FaultSpecError(f"fault {spec!r}: step must be >= 0")
    if not _INT.fullmatch(step_s) or not _NUMBER.fullmatch(factor_s):
        raise FaultSpecError(
            f"fault {spec!r}: step must be a whole number and factor a decimal number (2.5)"
        )
    step, factor = int(step_s), float(factor_s)
    if kind in ("compute-slow", "device-slow") and not 1.0 < factor <= 100.0:
        raise FaultSpecError(f"fault {spec!r}: factor must be in (1, 100]")
    rate = values.get("rate", "")
    if kind == "comm-slow" and not _RATE.fullmatch(rate):
        raise FaultSpecError(
            f"fault {spec!r}: rate {rate!r} must look like 20mbit (bit, kbit, mbit, gbit)"
        )
    peer_s = values.get("peer")
    if peer_s is not None and (not _INT.fullmatch(peer_s) or int(peer_s) == int(rank_s)):
        raise FaultSpecError(f"fault {spec!r}: peer must be a rank number other than {rank_s}")
    peer = int(peer_s) if peer_s is not None else None
    after_s = values.get("after_s", "0")
    if not _NUMBER.fullmatch(after_s) or float(after_s) > 600:
        raise FaultSpecError(f"fault {spec!r}: after_s must be seconds in [0, 600] (e.g. 0.5)")
    return FaultSpec(
        kind=kind,
        rank=int(rank_s),
        step=step,
        factor=factor,
        rate=rate,
        peer=peer,
        after_s=float(after_s),
    )


def parse_faults(texts: Iterable[str], world: int | None = None) -> list[FaultSpec]:
    """Parse several specs; ``none`` alone means no fault. Ranks are checked against
    ``world`` when it is given."""
    items = [t for t in texts if t.strip()]
    if [t.strip() for t in items] == ["none"]:
        return []
    faults = [parse_fault(t) for t in items]
    for f in faults:
        for what, r in (("rank", f.rank), ("peer", f.peer)):
            if world is not None and r is not None and r >= world:
                raise FaultSpecError(
                    f"fault {str(f)!r}: {what} {r} is outside the world of {world} ranks"
                )
    return faults
