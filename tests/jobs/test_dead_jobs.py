"""``ccld diagnose`` on the boards of real jobs that are gone: killed while hung, with a
mismatch, with a crashed rank, with a rank killed by SIGKILL. The post-mortem names what the
live diagnoser named, from the boards alone."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from job_runner import FAST_UNRESPONSIVE, demo, only
from trace_rules import check_trace

from ccld_harness.launch import LocalJob
from ccld_plugin.cli import main
from ccld_plugin.sinks.jsonl import read_verdicts

KEEP = (*FAST_UNRESPONSIVE, "board.cleanup=false")
TORCH = dict(framework="torch", overrides=KEEP, timeout_s=240, world=4, tp=1, pp=1, steps=40)
SAME = ("kind", "cause", "ranks", "group", "op", "trace_id", "step")


def _postmortem(boards: Path, out: Path) -> list[dict]:
    """``ccld diagnose`` as a user runs it, with nothing from the job but its boards."""
    assert main(["diagnose", str(boards), "--jsonl", str(out)]) == 0
    return read_verdicts(out)


def test_compute_hang_killed_while_hung(tmp_path):
    code, summary = demo(tmp_path / "out", "compute-hang@2:step=4", **TORCH)
    live = only(summary, "hang")
    assert code == 0 and summary["exit"] == [-15] * 4  # the demo ended the hung job
    (pm,) = _postmortem(tmp_path / "out" / "boards", tmp_path / "pm.jsonl")
    assert {k: pm[k] for k in SAME} == {k: live[k] for k in SAME}
    assert abs(pm["onset_s"] - live["onset_s"]) < 0.1  # one timebase: the diagnoser's clock
    assert pm["detected_s"] >= live["detected_s"]  # the boards' last word: the kill
    assert pm["stack"] and any("inject.py" in f for f in pm["stack"])
    # the demo's timeline, with the live verdict; and ``ccld trace`` over the dead boards
    by_ph = check_trace(json.loads((tmp_path / "out" / "trace.json").read_text()))
    assert [(e["pid"], e["name"]) for e in by_ph["i"]] == [(2, "hang (compute)")]
    assert main(["trace", str(tmp_path / "out" / "boards"), "-o", str(tmp_path / "t.json")]) == 0
    by_ph = check_trace(json.loads((tmp_path / "t.json").read_text()))
    (v,) = by_ph["i"]
    assert v["pid"] == 2 and v["args"]["trace_id"] == live["trace_id"]
    hung = [e for e in by_ph["X"] if e["args"].get("trace_id") == live["trace_id"]]
    assert sorted(e["pid"] for e in hung) == [0, 1, 3]  # rank 2 never entered it
    # every rank is on some collective's flow arrow (first, last or in between: which one
    # depends on the arrival order)
    assert {e["pid"] for e in by_ph["s"] + by_ph["t"] + by_ph["f"]} == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("fault", "layout", "ranks"),
    [("mismatch@3:step=4", {}, [3]), ("mismatch@1:step=4", {"tp": 2, "pp": 2}, [1])],
)
def test_mismatch(tmp_path, fault, layout, ranks):
    # DP4: the majority. TP2xPP2 (DP=1): rank 1's TP pair, whose other stage's pair is
    # not at that seq; the pair's recent collectives (the rings', sampled as the agents
    # sample a tick's) tell which member strayed, after the job as live.
    code, summary = demo(tmp_path / "out", fault, **{**TORCH, **layout})
    live = only(summary, "mismatch")
    assert live["ranks"] == ranks
    verdicts = _postmortem(tmp_path / "out" / "boards", tmp_path / "pm.jsonl")
    (pm,) = [v for v in verdicts if v["kind"] == "mismatch"]
    assert {k: pm[k] for k in SAME} == {k: live[k] for k in SAME}
    assert not [v for v in verdicts if v["kind"] == "hang"]


def test_crash_on_the_diagnoser_rank(tmp_path):
    # Rank 0, the diagnoser's, raises an exception its loop does not catch: its own last
    # round (on its way out) names it from its last summary, and so do the boards.
    code, summary = demo(tmp_path / "out", "crash@0:step=4", **TORCH)
    live = only(summary, "crash")
    assert (live["cause"], live["ranks"], live["step"]) == ("software", [0], 4)
    assert code == 0 and summary["exit"][0] == 1  # the crashed rank's own exit code
    (pm,) = _postmortem(tmp_path / "out" / "boards", tmp_path / "pm.jsonl")
    assert {k: pm[k] for k in SAME} == {k: live[k] for k in SAME}
    assert pm["stack"][-1].startswith("InjectedCrash: injected crash (crash@0:step=4)")


def test_rank_killed_first(tmp_path):
    out = tmp_path / "out"
    sets = [*KEEP, f"board.dir={out}", "job=b"]
    argv = ["-m", "ccld_harness.workload", "--steps", "400"]
    job = LocalJob(4, [*argv, *sum((["--ccld-set", s] for s in sets), [])], out / "logs")
    job.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "step" not in _log(out, 0):
            time.sleep(0.5)
        time.sleep(3)
        os.kill(job.procs[2].pid, signal.SIGKILL)
        job.wait(30)
    finally:
        job.stop()
    verdicts = _postmortem(out / "b", tmp_path / "pm.jsonl")
    (v,) = verdicts
    assert (v["kind"], v["ranks"]) == ("unresponsive", [2])
    assert v["evidence"][0]["fact"] == "process_gone"


@pytest.mark.parametrize(
    ("fault", "kind", "cause"),
    [("compute-hang@2:step=4", "hang", "compute"), ("kill@2:step=4", "unresponsive", "unknown")],
)
def test_job_ended_by_its_collective_timeouts(tmp_path, fault, kind, cause):
    """The job ends itself as jobs do: the peers' collectives time out (or raise when rank
    2's connection closes), they leave, the scheduler kills what is left. The boards at the
    end show three exited ranks and rank 2 in no collective; the verdict comes from the
    moment the first collective raised."""
    out = tmp_path / "out"
    sets = [*KEEP, f"board.dir={out}", "job=t"]
    argv = ["-m", "ccld_harness.workload", "--steps", "40", "--timeout-s", "8"]
    env = {"CCLD_FAULTS": fault, "OMP_NUM_THREADS": "1"}
    job = LocalJob(4, [*argv, *sum((["--ccld-set", s] for s in sets), [])], out / "logs", env)
    job.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(job.procs[r].poll() is None for r in (0, 1, 3)):
            time.sleep(0.5)
        codes = [job.procs[r].poll() for r in (0, 1, 3)]
        assert None not in codes and 0 not in codes, (codes, _log(out, 0))  # raised, or aborted
    finally:
        job.stop()
    (v,) = _postmortem(out / "t", tmp_path / "pm.jsonl")
    assert (v["kind"], v["cause"], v["ranks"], v["step"]) == (kind, cause, [2], 4), v
    if kind == "hang":
        assert v["group"]["role"] == "dp" and v["op"] == "all_reduce"
        assert v["stack"] and any("inject.py" in f for f in v["stack"])


def _log(out: Path, rank: int) -> str:
    path = out / "logs" / f"rank{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""
