"""Per-node aggregation on real gloo jobs whose ranks are split into simulated nodes of 2
(``control.ranks_per_node=2``): the store holds one key per node and no per-rank summary
key; hangs on a node's leader and on its other rank are diagnosed as with per-rank keys; a killed
leader is named unresponsive and the next rank of its node takes over, so that the node's
other rank is still diagnosed."""

from __future__ import annotations

from pathlib import Path

from job_runner import FAST_UNRESPONSIVE, demo, facts, only, run_job

from ccld_plugin.sinks.jsonl import read_verdicts

NODES_OF_2 = ("control.ranks_per_node=2",)
TORCH = dict(framework="torch", world=4, overrides=FAST_UNRESPONSIVE, timeout_s=240)


def _leading(res) -> dict[int, bool]:
    """Per rank: whether it led its node over most of the steps looked at (a leader late
    by two ticks on a loaded host hands one tick to the next rank of its node)."""
    return {r: line["leading"] > 0.5 for r in range(4) for line in res.json_lines(r, "NODE")}


def test_healthy_job_publishes_one_key_per_node(tmp_path: Path) -> None:
    res = run_job("node_summaries.py", 4, tmp_path, (str(tmp_path), "healthy")).check()
    (store,) = res.json_lines(0, "STORE")
    assert store["node_size"] == "2"
    assert store["ranks_in_frames"] == {"0": [0, 1], "1": [2, 3]}
    assert store["advanced"] == {"0": [0, 1], "1": [2, 3]}  # every rank's summary is fresh
    assert store["rank_keys"] == [] and not store["listed"]  # no per-rank summary key
    assert _leading(res) == {0: True, 1: False, 2: True, 3: False}
    assert read_verdicts(tmp_path / "verdicts.jsonl") == []


def test_killed_leader_is_named_and_its_node_goes_on(tmp_path: Path) -> None:
    # Rank 2 leads node 1 ({2, 3}) and kills itself; ranks 0, 1, 3 go on in a group of
    # their own, then rank 3 hangs in compute.
    res = run_job("node_summaries.py", 4, tmp_path, (str(tmp_path), "kill"))
    assert res.codes == [0, 0, -9, 0], res.logs
    (store,) = res.json_lines(0, "STORE")
    assert store["advanced"]["1"] == [3]  # node 1's key goes on carrying rank 3's summaries
    assert store["rank_keys"] == []
    assert _leading(res) == {0: True, 1: False, 3: True}  # rank 3 took node 1 over
    (verdicts,) = res.json_lines(0, "VERDICTS")
    lost = [v for v in verdicts if v["kind"] == "unresponsive"]
    assert [v["ranks"] for v in lost] == [[2]] and facts(lost[0]["evidence"])["process_gone"]
    (hang,) = [v for v in verdicts if v["kind"] == "hang"]
    assert (hang["cause"], hang["ranks"], hang["group"]["ranks"]) == ("compute", [3], [0, 1, 3])
    assert facts(hang["evidence"])["in_no_collective"]
    assert {v["kind"] for v in verdicts} == {"unresponsive", "hang"}


def test_compute_hang_on_a_node_leader(tmp_path: Path) -> None:
    code, summary = demo(
        tmp_path / "out", "compute-hang@2:step=4", extra=NODES_OF_2, tp=1, pp=1, steps=40, **TORCH
    )
    v = only(summary, "hang")
    assert (v["cause"], v["ranks"], v["group"]["role"]) == ("compute", [2], "dp")
    assert len(summary["verdicts"]) == 1 and code == 0


def test_compute_hang_on_a_rank_that_does_not_lead(tmp_path: Path) -> None:
    code, summary = demo(
        tmp_path / "out", "compute-hang@3:step=4", extra=NODES_OF_2, tp=1, pp=1, steps=40, **TORCH
    )
    v = only(summary, "hang")
    assert (v["cause"], v["ranks"], v["group"]["role"]) == ("compute", [3], "dp")
    assert len(summary["verdicts"]) == 1 and code == 0


def test_killed_leader_is_unresponsive_in_the_demo(tmp_path: Path) -> None:
    # As tests/jobs/test_diagnoser_rank.py's killed rank, now the leader of node 1.
    code, summary = demo(
        tmp_path / "out", "kill@2:step=5", extra=NODES_OF_2, tp=2, pp=2, steps=40, **TORCH
    )
    v = only(summary, "unresponsive")
    assert v["ranks"] == [2] and facts(v["evidence"])["process_gone"]
    assert not [x for x in summary["verdicts"] if x["kind"] in ("hang", "deadlock")]
    assert summary["latency_s"][0]["verdict"] and code == 0
