"""Which verdict each injected fault should get (kind and cause), and the verdicts of a
run matched to its faults, with the latency from each fault's onset: what the demo and
the benchmarks judge a run by.
"""

from __future__ import annotations

from ccld_harness.faults.spec import FaultSpec

__all__ = ["expected_verdict", "match_faults"]

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
