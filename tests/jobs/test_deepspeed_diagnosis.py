"""Verdicts on real DeepSpeed jobs (examples/deepspeed/train.py, 4 ranks, gloo on the CPU
accelerator), with ZeRO-2 and ZeRO-3, each fault injected through the demo's launcher."""

import json

import pytest

from ccld_plugin.harness.demo import DemoOptions, run_demo

FAST = ["diagnoser.hang_min_s=3", "agent.stack_after_s=1", "agent.interval_s=0.5"]


def ds_demo(tmp_path, zero, steps, fault):
    opts = DemoOptions(
        framework="deepspeed",
        world=4,
        steps=steps,
        faults=[fault],
        out=tmp_path / "out",
        overrides=FAST,
        timeout_s=300,
        zero_stage=zero,
    )
    code = run_demo(opts)
    return code, json.loads((tmp_path / "out" / "summary.json").read_text())


@pytest.mark.parametrize("zero", [2, 3])
def test_compute_hang(tmp_path, zero):
    code, summary = ds_demo(tmp_path, zero, 40, "compute-hang@2:step=3")
    (v,) = summary["verdicts"]
    assert (v["kind"], v["cause"], v["ranks"], v["group"]["role"]) == ("hang", "compute", [2], "dp")
    assert v["stack"] and code == 0


@pytest.mark.parametrize("zero", [2, 3])
def test_compute_slow(tmp_path, zero):
    code, summary = ds_demo(tmp_path, zero, 40, "compute-slow@1:factor=2,step=3")
    slow = [v for v in summary["verdicts"] if v["kind"] == "slow"]
    assert [(v["cause"], v["ranks"], v["group"]["role"]) for v in slow] == [
        ("compute", [1], "dp")
    ], summary["verdicts"]
    assert 1.3 <= slow[0]["severity"] <= 3.0 and code == 0


def test_healthy_zero2_run_has_no_verdict(tmp_path):
    code, summary = ds_demo(tmp_path, 2, 60, "none")
    assert summary["verdicts"] == [] and summary["steps_completed"] == 60 and code == 0
