"""Faults at the diagnoser's own rank are diagnosed like faults anywhere else, with the
diagnoser at rank 0 and elsewhere; and a rank that kills itself (``kill@R``) is named
unresponsive, whichever rank it is. (Its link cut or shaped: tests/jobs/test_comm_faults.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from job_runner import FAST_UNRESPONSIVE, demo, facts, only

TORCH = dict(framework="torch", timeout_s=240)


def _demo(tmp_path: Path, fault: str, diagnoser: int, **options: object) -> tuple[int, dict]:
    return demo(
        tmp_path / "out",
        fault,
        **{
            "world": 4,
            "tp": 1,
            "pp": 1,
            "steps": 40,
            "overrides": (*FAST_UNRESPONSIVE, f"diagnoser.rank={diagnoser}"),
            **TORCH,
            **options,
        },
    )


def test_compute_hang_at_a_diagnoser_that_is_not_rank_0(tmp_path: Path) -> None:
    code, summary = _demo(tmp_path, "compute-hang@2:step=4", diagnoser=2)
    v = only(summary, "hang")
    assert (v["cause"], v["ranks"], v["group"]["role"]) == ("compute", [2], "dp")
    assert len(summary["verdicts"]) == 1 and code == 0


def test_compute_slow_at_the_diagnoser_rank(tmp_path: Path) -> None:
    # Its own rounds run beside its training: they must not hide its straggling (nor
    # make a healthy diagnoser rank look slow: the healthy-run tests check that).
    code, summary = _demo(tmp_path, "compute-slow@1:factor=3,step=3", diagnoser=1, steps=30)
    v = only(summary, "slow", "compute")
    assert v["ranks"] == [1] and v["group"]["role"] == "dp"
    assert facts(v["evidence"])["compute_excess"][0]["data"]["ratio"] >= 1.5
    assert len(summary["verdicts"]) == 1 and code == 0


def test_killed_rank_is_unresponsive(tmp_path: Path) -> None:
    code, summary = _demo(tmp_path, "kill@2:step=5", diagnoser=0, tp=2, pp=2)
    v = only(summary, "unresponsive")
    assert v["ranks"] == [2]
    assert facts(v["evidence"])["process_gone"]
    # Where it died, as its board kept it (its node's leader reads it once it is gone),
    # not where its last summary, up to an interval older, had it.
    assert v["step"] == 5 and facts(v["evidence"])["last_op"][0]["data"]["step"] == 5
    # The peers' hangs (or errors) are its effects, not verdicts of their own.
    assert not [x for x in summary["verdicts"] if x["kind"] in ("hang", "deadlock")]
    assert summary["latency_s"][0]["verdict"] and code == 0


@pytest.mark.parametrize("diagnoser", [0, 1])
def test_killed_diagnoser_is_named_by_its_standby(tmp_path: Path, diagnoser: int) -> None:
    # The diagnoser rank dies; its gloo peers fail at once, and on their way out the
    # standby (the next rank on this one node) takes the lease over and names it.
    code, summary = _demo(tmp_path, f"kill@{diagnoser}:step=5", diagnoser=diagnoser)
    v = only(summary, "unresponsive")
    assert v["ranks"] == [diagnoser] and facts(v["evidence"])["process_gone"]
    # the step it died in, from its board (the job came down too fast for a node leader
    # to publish it: the standby, on its host, reads the board itself)
    assert v["step"] == 5, v
    assert summary["latency_s"][0]["verdict"] and code == 0
    standby = diagnoser + 1
    log = (tmp_path / "out" / "logs" / f"rank{standby}.log").read_text()
    assert f"rank {standby} takes diagnosis over from rank {diagnoser}" in log


def test_frozen_diagnoser_is_taken_over_while_the_job_hangs(tmp_path: Path) -> None:
    # SIGSTOP: the diagnoser's process stays, its connections open, so its peers hang
    # instead of failing. Its lease lapses; the standby takes over live, names it
    # unresponsive, and the peers' hangs are not blamed on anyone else.
    code, summary = _demo(tmp_path, "freeze@0:step=5", diagnoser=0)
    v = only(summary, "unresponsive")
    assert v["ranks"] == [0] and facts(v["evidence"])["heartbeat_stopped"]
    assert not [x for x in summary["verdicts"] if x["kind"] in ("hang", "deadlock")]
    assert summary["latency_s"][0]["verdict"] and code == 0
    # 4 intervals of lease + unresponsive_s (4 s) after the freeze, with slack for load.
    assert summary["latency_s"][0]["latency_s"] <= 4 * 0.5 + 4 + 6
    assert (
        "rank 1 takes diagnosis over from rank 0"
        in (tmp_path / "out" / "logs" / "rank1.log").read_text()
    )


def test_diagnoser_as_a_process_of_its_own(tmp_path: Path) -> None:
    # diagnoser.rank=-1: no rank runs one; `ccld diagnoser` beside the job serves the
    # clock, holds the lease and names the hang like the diagnoser thread would.
    code, summary = _demo(tmp_path, "compute-hang@1:step=4", diagnoser=-1, diagnoser_process=True)
    v = only(summary, "hang")
    assert (v["cause"], v["ranks"], v["group"]["role"]) == ("compute", [1], "dp")
    assert summary["latency_s"][0]["latency_s"] <= 30 and code == 0
    log = (tmp_path / "out" / "logs" / "diagnoser.log").read_text()
    assert "ccld diagnoser: job 'boards', 4 ranks" in log
    assert "takes diagnosis over" not in (tmp_path / "out" / "logs" / "rank0.log").read_text()


def test_a_job_that_ends_with_its_store_beside_a_diagnoser_process_has_no_verdict(
    tmp_path: Path,
) -> None:
    # The demo's store is rank 0's: it ends with rank 0, often before the other ranks'
    # final summaries reach it. Their boards, closed on their way out, tell the diagnoser
    # process that they left cleanly (before: all four named unresponsive in 1 of 2 runs).
    code, summary = _demo(
        tmp_path, "none", diagnoser=-1, diagnoser_process=True, tp=2, pp=2, steps=60
    )
    assert summary["verdicts"] == [] and summary["exit"] == [0, 0, 0, 0] and code == 0
