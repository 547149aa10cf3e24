"""What a demo's run left, and whether it is what the demo was asked for: which verdict
each injected fault should get (kind and cause), the run's verdicts matched to its faults
with the latency from each fault's onset (what the demo and the benchmarks judge a run
by), and whether the job trained every step and ended, every injected fault was
diagnosed, a healthy run got no verdict. A miss is told in one line."""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ccld_harness.faults.spec import FaultSpec
from ccld_plugin.errors import CONTAINED

if TYPE_CHECKING:
    from ccld_harness.options import DemoOptions

__all__ = [
    "TERMINAL",
    "Outcome",
    "expected_verdict",
    "logged_errors",
    "match_faults",
    "why_failed",
]

EXPECTED = {
    "compute-hang": ("hang", "compute"),
    "compute-slow": ("slow", "compute"),
    "mismatch": ("mismatch", "software"),
    "comm-slow": ("slow", "communication"),
    "comm-hang": ("hang", "communication"),
    "kill": ("unresponsive", "unknown"),
    "crash": ("crash", "software"),
    "freeze": ("unresponsive", "unknown"),
    "cpu-contention": ("slow", "compute"),
    "device-slow": ("slow", "compute"),
    "device-hang": ("hang", "compute"),
}


def expected_verdict(fault: FaultSpec | dict) -> tuple[str, str]:
    kind = fault.kind if isinstance(fault, FaultSpec) else fault["kind"]
    return EXPECTED[kind]


def match_faults(faults: list[dict], verdicts: list[dict]) -> list[dict]:
    """For each injected fault, the first verdict that names its rank with the expected
    kind and cause, and the latency from the fault's onset."""
    out = []
    for f in faults:
        kind, cause = expected_verdict(f)
        hit = next(
            (
                v
                for v in verdicts
                if v["kind"] == kind and v["cause"] == cause and f["rank"] in v["ranks"]
            ),
            None,
        )
        latency = None
        if hit is not None and f.get("onset_s") is not None:
            latency = round(hit["detected_s"] - f["onset_s"], 2)
        out.append(
            {
                "fault": f["fault"],
                "verdict": hit is not None,
                "latency_s": latency,
                "steps_to_verdict": (hit["step"] - f["step"])
                if hit and hit.get("step") is not None and kind == "slow"
                else None,
            }
        )
    return out


# verdicts that mean the job will not recover: the demo ends it a grace period after one
TERMINAL = {"hang", "deadlock", "mismatch", "unresponsive", "crash"}


@dataclass
class Outcome:
    """What a run left, to judge it by."""

    faults: list[FaultSpec]
    injected: list[dict]
    latency: list[dict]  # match_faults(injected, verdicts)
    verdicts: list[dict]
    codes: list[int | None]
    steps: int  # completed by every rank
    ended: str  # Followed.ended


def why_failed(o: Outcome, opts: DemoOptions, logs: Path) -> str | None:
    """Why a run is not what the demo was asked for (None: it is), in one line: the job's
    failure (unless a fault that breaks the job was diagnosed: the ranks' ends are its),
    then the diagnosis'."""
    alive = [r for r, c in enumerate(o.codes) if c is None]
    if alive:
        return f"ranks {alive} did not end when killed"
    on_purpose = any(
        m["verdict"] and expected_verdict(f)[0] in TERMINAL
        for f, m in zip(o.injected, o.latency, strict=True)
    )
    job = None if on_purpose else _job_failure(o, opts, logs)
    problems = [p for p in (job, _diagnosis_failure(o)) if p is not None]
    return "; ".join(problems) or None


def _diagnosis_failure(o: Outcome) -> str | None:
    """A fault not injected or not diagnosed, or a verdict in a healthy run."""
    injected = {f["fault"] for f in o.injected}
    for spec in o.faults:
        if str(spec) not in injected:
            return f"fault {spec} was never injected (the ranks completed {o.steps} steps)"
    for f, m in zip(o.injected, o.latency, strict=True):
        if not m["verdict"]:
            kind, cause = expected_verdict(f)
            return (
                f"fault {m['fault']} was not diagnosed: no {kind} verdict with cause {cause} "
                f"naming rank {f['rank']} among {len(o.verdicts)} verdict(s)"
            )
    if not o.faults and o.verdicts:
        kinds = ", ".join(sorted({v["kind"] for v in o.verdicts}))
        return f"the healthy run got {len(o.verdicts)} verdict(s) ({kinds})"
    return None


def _job_failure(o: Outcome, opts: DemoOptions, logs: Path) -> str | None:
    """Why the job itself failed (None: it trained every step and exited cleanly)."""
    at = f"after {o.steps} of {opts.steps} steps"
    if o.ended == "timeout":
        return f"the job did not end within {opts.timeout_s:g} s ({at}); it was killed"
    if o.ended == "verdict":
        kinds = ", ".join(sorted({v["kind"] for v in o.verdicts if v["kind"] in TERMINAL}))
        return f"the job was ended {at}, after a {kinds} verdict that no injected fault explains"
    bad = {r: c for r, c in enumerate(o.codes) if c != 0}
    if bad:
        by_reason: dict[str, list[int]] = {}
        for r, c in bad.items():
            by_reason.setdefault(_exit_reason(c, logs / f"rank{r}.log"), []).append(r)
        told = "; ".join(f"{_who(ranks)} {reason}" for reason, ranks in list(by_reason.items())[:2])
        return f"ranks {sorted(bad)} failed {at}: {told}"
    if o.steps < opts.steps:
        return f"the job ended {at}"
    return None


def logged_errors(logs: Path) -> list[str]:
    """The errors the plugin contained in the job's processes, as each log told them first
    (``errors.report_error``): "rank2: ccld: contained error in ...", one per place."""
    found = []
    for log in sorted(logs.glob("*.log")):
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                at = line.find(CONTAINED)
                if at >= 0:
                    found.append(f"{log.stem}: {line[at:].strip()}")
    return found


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _exit_reason(code: int | None, log: Path) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code} ({_last_line(log)})"


def _last_line(log: Path, limit: int = 200) -> str:
    """The last line a rank wrote (a traceback's ends with the exception), shortened."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError as exc:
        return f"no log ({exc.strerror})"
    last = next((ln for ln in reversed(lines) if ln), "its log is empty")
    return last if len(last) <= limit else last[: limit - 3] + "..."
