"""Device time on the simulated device (``ccld demo --device sim``): collectives return at
once, the host blocks only at one sync point a step, and the plugin reads compute, arrivals
and hangs from the device timeline (timing events on the device's streams).

Per layout (TP2 x PP2, DP4, a lone pipeline of two stages), one job with two faults: a 2x
device-slow rank (its kernels twice as long, its host not slowed) is named a compute
straggler, and where it has a cohort the same run's host measure does not name it (its
rounds replayed with each step's compute the host's own); then a device hang on another
rank is a compute hang of that rank. A link cut under the simulated device is a
communication hang; a healthy run of 200 steps has no verdict."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from job_runner import CUT_LINK, FAST_UNRESPONSIVE, demo, netns_demo, only

from ccld_harness.faults import netns
from ccld_plugin.config import load_config
from ccld_plugin.postmortem.replay import replay
from ccld_plugin.recording import RecordedRound, RoundRecorder, read_recording
from ccld_plugin.wire.codes import TIME_EVENTS, TIME_HOST
from ccld_plugin.wire.summary import decode_summary, encode_summary

SIM = dict(framework="torch", device="sim", timeout_s=240)
NO_WANDB = "sinks.wandb.enabled=false"  # not what these tests look at; its writer takes a core


def _sim_demo(tmp_path: Path, *faults: str, **options) -> tuple[int, dict]:
    rec = tmp_path / "rounds.rec"
    overrides = (*FAST_UNRESPONSIVE, f"diagnoser.record={rec}", NO_WANDB)
    return demo(tmp_path / "out", *faults, overrides=overrides, **{**SIM, **options})


def _host_only(rec: Path, out: Path) -> dict[int, list[int]]:
    """``rec``'s rounds again with every step's compute the host's own measure (what the
    analysis reads without a device timeline), written to ``out``; each rank's host
    compute per step, as its summaries told it."""
    config, rounds = read_recording(rec)
    host: dict[int, dict[int, int]] = {}
    recorder = RoundRecorder(out, config)
    for r in rounds:
        values = {}
        for rank, value in r.values.items():
            s = decode_summary(value)
            assert s.time_source & 0xF == TIME_EVENTS  # the live diagnoser read device time
            for st in s.steps:
                host.setdefault(rank, {})[st.step] = st.host_compute_us
            s.steps = [st._replace(compute_us=st.host_compute_us, cpu_wait_us=0) for st in s.steps]
            s.time_source = TIME_HOST
            values[rank] = encode_summary(s)
        recorder.write(RecordedRound(**{**r.__dict__, "values": values}))
    recorder.close()
    return {rank: list(steps.values()) for rank, steps in host.items()}


def _host_does_not_name(tmp_path: Path, rank: int) -> None:
    """The premise: the host's compute of ``rank`` is its peers' within the ratio the
    analysis needs to call a rank slower, and the analysis on it names no straggler."""
    host = _host_only(tmp_path / "rounds.rec", tmp_path / "host.rec")
    medians = {r: statistics.median(v[5:]) for r, v in host.items()}
    others = statistics.median(m for r, m in medians.items() if r != rank)
    assert medians[rank] < load_config(None).diagnoser.slow_ratio * others, medians
    _, verdicts = replay(tmp_path / "host.rec")
    assert not [v for v in verdicts if v.kind.value == "slow" and rank in v.ranks]


@pytest.mark.parametrize(
    ("world", "tp", "pp", "slow", "hang", "roles"),
    [(4, 2, 2, 1, 2, {"tp", "pp"}), (4, 1, 1, 3, 1, {"dp"}), (2, 1, 2, 0, 1, {"pp"})],
    ids=["tp2-pp2", "dp4", "lone-pipeline"],
)
def test_device_slow_and_device_hang_are_compute_of_their_rank(
    tmp_path, world, tp, pp, slow, hang, roles
):
    code, summary = _sim_demo(
        tmp_path,
        f"device-slow@{slow}:factor=2,step=10",
        f"device-hang@{hang}:step=45",
        world=world,
        tp=tp,
        pp=pp,
        steps=60,
    )
    v = only(summary, "slow")
    assert (v["cause"], v["ranks"]) == ("compute", [slow])
    assert v["group"]["role"] in roles and slow in v["group"]["ranks"]
    h = only(summary, "hang")
    assert (h["cause"], h["ranks"]) == ("compute", [hang])
    assert h["group"]["role"] in roles and hang in h["group"]["ranks"]
    assert code == 0, summary["failure"]
    if world > pp:
        # The premise holds where the rank has a cohort: its peers' hosts block at the sync
        # point as long as its own. A lone stage is judged against its own past instead,
        # and its host's wait at the sync point for its own slower device is a change
        # there too: the host measure may name it as well (it did in some runs).
        _host_does_not_name(tmp_path, slow)


def test_a_healthy_run_of_200_steps_on_the_simulated_device_has_no_verdict(tmp_path):
    code, summary = _sim_demo(tmp_path, "none", world=4, tp=2, pp=2, steps=200)
    assert summary["verdicts"] == [] and summary["steps_completed"] == 200
    assert code == 0, summary["failure"]


@pytest.mark.skipif(not netns.available()[0], reason=netns.available()[1])
def test_a_cut_link_under_the_simulated_device_is_communication(tmp_path):
    # Cut once the ranks report: a host on the device runs ahead, and step 6 can come
    # before rank 1's first summary reaches the store; a rank never seen is not named
    # (the diagnoser waits for what it has not heard from).
    fault = "comm-hang@1:step=30"  # about 3 s in: the agents publish every second
    code, summary = netns_demo(
        tmp_path, 1, 2, 60, fault, world=2, device="sim", extra=(*CUT_LINK, NO_WANDB)
    )
    v = only(summary, "hang", "communication")
    assert (v["ranks"], v["link"], v["group"]["role"]) == ([0, 1], [0, 1], "pp")
    assert len(summary["verdicts"]) == 1 and code == 0, summary["failure"]
