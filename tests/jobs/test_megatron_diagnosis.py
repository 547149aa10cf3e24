"""Verdicts on real Megatron-core jobs (the GPT example, TP2 x PP2 on gloo), each fault
injected through the demo's launcher. Ranks: TP pairs (0,1),(2,3); pipelines (0,2),(1,3);
ranks 2 and 3 are the last pipeline stage."""

from job_runner import demo

MEGATRON = dict(framework="megatron", world=4, tp=2, pp=2, timeout_s=300)


def test_compute_hang_on_the_last_pipeline_stage(tmp_path):
    code, summary = demo(tmp_path / "out", "compute-hang@3:step=3", steps=30, **MEGATRON)
    (v,) = summary["verdicts"]
    assert (v["kind"], v["cause"], v["ranks"]) == ("hang", "compute", [3])
    assert v["group"]["role"] == "tp" and v["group"]["ranks"] == [2, 3]
    assert v["stack"] and code == 0


def test_compute_slow_on_one_tp_rank_names_it_not_its_peer(tmp_path):
    code, summary = demo(tmp_path / "out", "compute-slow@1:factor=2,step=3", steps=40, **MEGATRON)
    slow = [v for v in summary["verdicts"] if v["kind"] == "slow"]
    assert [(v["cause"], v["ranks"]) for v in slow] == [("compute", [1])], summary["verdicts"]
    assert 1.3 <= slow[0]["ratio"] <= 3.0
    assert code == 0


def test_healthy_megatron_run_has_no_verdict(tmp_path):
    code, summary = demo(tmp_path / "out", "none", steps=40, **MEGATRON)
    assert summary["verdicts"] == [] and summary["steps_completed"] == 40
    assert code == 0


def test_mismatch_in_a_tensor_parallel_pair_at_dp1(tmp_path):
    # DP=1: Megatron's data-parallel group of rank 2 is rank 2 alone, so the fault takes
    # its TP group (before: an all-gather of one member, nothing mismatched, no verdict).
    # Two members that disagree leave no majority, and the other stage's TP pair is not at
    # that seq (it waits for this stage's activations): the pair's own recent collectives,
    # of the size rank 3 entered and never of rank 2's, name rank 2.
    code, summary = demo(tmp_path / "out", "mismatch@2", steps=30, **MEGATRON)
    (v,) = summary["verdicts"]
    assert (v["kind"], v["cause"], v["ranks"]) == ("mismatch", "software", [2])
    assert v["group"]["role"] == "tp" and v["group"]["ranks"] == [2, 3]
    entered = {
        e["data"]["rank"]: e["data"]["op"] for e in v["evidence"] if e["fact"] == "entered_op"
    }
    assert entered == {2: "all_gather_into_tensor", 3: "all_reduce"}, v["evidence"]
    (history,) = [e["data"] for e in v["evidence"] if e["fact"] == "group_history"]
    assert history["usual"] == [3] and history["op"] == "all_reduce"
    assert code == 0


def test_mismatch_on_a_stage_of_a_pipeline_alone(tmp_path):
    # TP1xPP4: no group but the pipeline's has peers. Rank 2 begins an all-gather over it
    # that no other stage enters; they wait in their sends and receives. The waits form a
    # cycle, yet what broke is one member's order of ops: a mismatch naming rank 2.
    options = {**MEGATRON, "tp": 1, "pp": 4}
    code, summary = demo(tmp_path / "out", "mismatch@2", steps=30, **options)
    (v,) = summary["verdicts"]
    assert (v["kind"], v["cause"], v["ranks"]) == ("mismatch", "software", [2])
    assert v["group"]["ranks"] == [0, 1, 2, 3] and v["op"] == "all_gather_into_tensor"
    (waiting,) = [e["data"] for e in v["evidence"] if e["fact"] == "in_transfers"]
    assert waiting["ranks"] == [0, 1, 3]
    assert code == 0
