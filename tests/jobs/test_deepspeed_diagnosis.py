"""Verdicts on real DeepSpeed jobs (examples/deepspeed/train.py, 4 ranks, gloo on the CPU
accelerator), each fault injected through the demo's launcher: the hang under ZeRO-3, the
straggler under ZeRO-2 (the ZeRO-2 hang of an unchanged script: test_ccld_run.py; what
each stage's collectives look like on the boards: test_deepspeed_plugin.py)."""

from job_runner import demo


def test_compute_hang_zero3_on_3_ranks(tmp_path):
    # DeepSpeed runs data parallel only: the demo's --tp / --pp defaults (2 x 2) do not
    # apply, and a world they do not divide runs.
    code, summary = demo(
        tmp_path / "out",
        "compute-hang@2:step=3",
        framework="deepspeed",
        zero_stage=3,
        world=3,
        steps=40,
        timeout_s=300,
    )
    (v,) = summary["verdicts"]
    assert (v["kind"], v["cause"], v["ranks"], v["group"]["role"]) == ("hang", "compute", [2], "dp")
    assert v["group"]["ranks"] == [0, 1, 2]
    assert v["stack"] and code == 0


def test_compute_slow_zero2(tmp_path):
    code, summary = demo(
        tmp_path / "out",
        "compute-slow@1:factor=2,step=3",
        framework="deepspeed",
        zero_stage=2,
        steps=40,
        timeout_s=300,
    )
    slow = [v for v in summary["verdicts"] if v["kind"] == "slow"]
    assert [(v["cause"], v["ranks"], v["group"]["role"]) for v in slow] == [
        ("compute", [1], "dp")
    ], summary["verdicts"]
    assert 1.3 <= slow[0]["ratio"] <= 3.0 and code == 0


def test_healthy_zero2_run_has_no_verdict(tmp_path):
    code, summary = demo(
        tmp_path / "out", "none", framework="deepspeed", zero_stage=2, steps=60, timeout_s=300
    )
    assert summary["verdicts"] == [] and summary["steps_completed"] == 60 and code == 0
