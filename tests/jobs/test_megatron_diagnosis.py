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
    assert 1.3 <= slow[0]["severity"] <= 3.0
    assert code == 0


def test_healthy_megatron_run_has_no_verdict(tmp_path):
    code, summary = demo(tmp_path / "out", "none", steps=40, **MEGATRON)
    assert summary["verdicts"] == [] and summary["steps_completed"] == 40
    assert code == 0
