"""Bad input refused at start, in one line, from the API and the command line: config
files and values, paths the plugin cannot write, job names, steps; a sink that breaks
after the start is contained alone; corrupt summaries and group tables from the store are
counted and left out; and the demo's judgement of a run."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from builders import NOW, peer_channel, rank_summary

import ccld_plugin
from ccld_harness.faults.spec import parse_fault
from ccld_harness.options import DemoOptions, fit_layout
from ccld_harness.outcome import Outcome, logged_errors, why_failed
from ccld_plugin.config import CcldConfig, ConfigError, SinksConfig, load_config
from ccld_plugin.errors import log as ccld_log
from ccld_plugin.errors import report_error
from ccld_plugin.services import job_folder, session
from ccld_plugin.services.diagnoser import Diagnoser
from ccld_plugin.services.job_folder import FolderRefused
from ccld_plugin.sinks import ConsoleSink, build_sinks
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.peer_channels import encode_channels
from ccld_plugin.wire.summary import InFlightOp, P2PSample, encode_summary, p2p_samples


def _ccld_config(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ccld_plugin.cli", "config", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("diagnoser: [1,2\n", r"is not valid YAML at line 2, column 1"),
        ("- 1\n- 2\n", r"holds a list; expected YAML keys"),
        ("3\n", r"holds one value, '3'; expected YAML keys"),
        ("job: !!python/object:os.system x\n", r"line 1: job: the YAML tag .* is not supported"),
    ],
)
def test_a_malformed_config_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert "\n" not in str(info.value)
    out = _ccld_config("--config", str(path))
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("ccld: error: ccld config: file ")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["job=../evil"], r"job='../evil' is not allowed"),
        (["job=a/b"], r"job='a/b' is not allowed"),
        (["job=.."], r"job='..' is not allowed"),
        (["job=[1,2"], r"job='\[1,2' is not allowed; expected 1-63"),
        (["sinks.jsonl=/proc/x/y.jsonl"], r"sinks.jsonl='/proc/x/y.jsonl' cannot be written"),
        (["board.dir=/proc/ccld"], r"board.dir='/proc/ccld' cannot be written"),
        (
            ["sinks.wandb.enabled=true", "sinks.wandb.dir=/proc/w"],
            r"sinks.wandb.dir='/proc/w' cannot be written",
        ),
        (["agent.clock_resync_s=inf"], r"agent.clock_resync_s=inf is not allowed"),
        (["control.connect_timeout_s=1e300"], r"control.connect_timeout_s=1e\+300"),
        (["diagnoser.hang_min_s=nan"], r"diagnoser.hang_min_s=nan is not allowed"),
    ],
)
def test_a_value_that_cannot_work_is_refused_at_start(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, overrides)
    assert "\n" not in str(info.value)
    out = _ccld_config(*sum((["--set", o] for o in overrides), []))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_a_path_under_a_file_is_refused_and_a_disabled_config_is_not_checked(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"f is not a folder"):
        load_config(None, [f"sinks.jsonl={tmp_path / 'f' / 'v.jsonl'}"])
    cfg = load_config(None, ["enabled=false", f"sinks.jsonl={tmp_path / 'f' / 'v.jsonl'}"])
    assert not cfg.enabled


def test_good_job_names_and_paths_pass(tmp_path):
    cfg = load_config(None, ["job=run-2_x.y", f"sinks.jsonl={tmp_path / 'new' / 'v.jsonl'}"])
    assert cfg.job == "run-2_x.y" and not (tmp_path / "new").exists()  # nothing created
    assert cfg.board_root() == Path(f"/dev/shm/ccld-{os.getuid()}")


@pytest.mark.parametrize("source", [123, [1, 2], b"x"])
def test_a_config_of_another_type_is_one_line(source):
    with pytest.raises(ConfigError, match="is not allowed; expected a CcldConfig"):
        load_config(source)


def test_a_passed_config_object_has_its_paths_checked_too():
    cfg = CcldConfig(sinks=SinksConfig(jsonl="/proc/x/y.jsonl"))
    with pytest.raises(ConfigError, match="cannot be written"):
        ccld_plugin.enable(cfg)


def test_a_job_name_from_the_environment_is_made_safe(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "../../etc/x y")
    name = session.job_name(CcldConfig())
    assert "/" not in name and ".." not in name and name[0].isalnum()


@pytest.mark.parametrize("step", ["x", 1.5, None, True])
def test_mark_step_takes_integers_only(step):
    with pytest.raises(TypeError, match="step must be an integer"):
        ccld_plugin.mark_step(step)


@pytest.mark.parametrize("step", [-1, 2**31])
def test_mark_step_takes_steps_a_board_can_hold(step):
    with pytest.raises(ValueError, match=r"outside 0\.\.2147483647"):
        ccld_plugin.mark_step(step)


def test_mark_step_is_checked_with_the_plugin_on_too(monkeypatch):
    class Board:
        def set_step(self, step: int) -> None:
            raise AssertionError("a bad step reached the board")

    fake = type("S", (), {"board": Board(), "tracer": None, "services": None})()
    monkeypatch.setattr(session, "_session", fake)
    with pytest.raises(TypeError):
        ccld_plugin.mark_step("x")


def test_a_job_folder_of_another_user_is_refused(tmp_path):
    job = tmp_path / "ccld-{uid}".replace("{uid}", str(os.getuid())) / "j"
    job.mkdir(parents=True)
    os.chown(job, 12345, 12345)
    cfg = load_config(None, [f"board.dir={tmp_path}/ccld-{{uid}}", "job=j"])
    with pytest.raises(FolderRefused, match="owned by uid 12345"):
        job_folder.claim(cfg.board_root(), True, job, "token", 1, 0)


def test_board_folders_are_made_private(tmp_path):
    cfg = load_config(None, [f"board.dir={tmp_path}/ccld-{{uid}}", "job=j"])
    job = cfg.board_root() / "j"
    folder = job_folder.claim(cfg.board_root(), True, job, "token", 1, 0)
    board = session._create_board(cfg, job / "rank0.board", 0, 1, "j")
    try:
        for path in (job.parent, job):
            assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert stat.S_IMODE((job / "rank0.board").stat().st_mode) == 0o600
    finally:
        board.close(unlink=True)
        folder.release(cleanup=True)
    assert not job.exists()  # the last rank out leaves nothing behind


def test_a_sink_that_cannot_be_opened_is_left_out_alone(tmp_path):
    (tmp_path / "f").write_text("")
    sinks = build_sinks(SinksConfig(console=True, jsonl=str(tmp_path / "f" / "v.jsonl")))
    assert [type(s) for s in sinks] == [ConsoleSink]


def test_a_new_verdicts_file_is_private(tmp_path):
    (sink,) = build_sinks(SinksConfig(console=False, jsonl=str(tmp_path / "d" / "v.jsonl")))
    sink.close()
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "d" / "v.jsonl").stat().st_mode) == 0o600


class _Store:
    rank = 0
    store_local = True

    def __init__(self, groups: dict[int, object]) -> None:
        self.groups = groups

    def read_groups(self, rank: int) -> tuple[int, list[GroupInfo]]:
        value = self.groups[rank]
        if isinstance(value, Exception):
            raise value
        assert isinstance(value, list)
        return 1, value


def test_corrupt_summaries_and_group_tables_are_counted_and_left_out():
    good = GroupInfo(7, "dp", (0, 1, 2, 3))
    control = _Store(
        {0: [good], 1: [good], 2: [GroupInfo(7, "dp", (2, 9))], 3: KeyError("version")}
    )
    svc = Diagnoser(CcldConfig(), control, 4, 0, [])  # type: ignore[arg-type]
    raw = {r: encode_summary(rank_summary(r)) for r in range(4)}
    raw[1] = raw[1][:-3]  # torn
    raw[3] = encode_summary(rank_summary(0))  # under another rank's key
    decoded = svc._summaries(raw)
    assert sorted(decoded) == [0, 2]
    p2p = rank_summary(0, time_ns=2, in_flight=[InFlightOp(0, 11, 2, 8, 1, 4, 0)])
    again = svc._summaries({0: encode_summary(p2p), 2: b"\x01"})  # a peer outside the job
    assert again == decoded  # the last good summaries stand in: their heartbeats age
    assert svc._read_table(2) is None and svc._read_table(3) is None
    assert svc._read_table(0) == (1, [good])


def test_channel_evidence_naming_a_rank_outside_the_job_is_left_out_alone():
    # The rank's channels go, its point-to-point samples (encoded after them) stay, and
    # the value kept for it decodes in the rounds after.
    svc = Diagnoser(CcldConfig(), _Store({}), 2, 0, [])  # type: ignore[arg-type]
    p2p = [P2PSample(0, 1, True, 7, NOW - 5_000_000, 5, 4096)]
    s = rank_summary(0, p2p=p2p, channels=encode_channels([peer_channel(5)], 1.0, 1))
    table = svc._summaries({0: encode_summary(s)})
    assert table[0].channels == b"" and p2p_samples(table[0]) == p2p
    later = svc._summaries({1: encode_summary(rank_summary(1))})
    assert sorted(later) == [0, 1] and p2p_samples(later[0]) == p2p


def _outcome(**fields: object) -> Outcome:
    base: dict = dict(
        faults=[], injected=[], latency=[], verdicts=[], codes=[0, 0], steps=40, ended="exited"
    )
    return Outcome(**{**base, **fields})


def test_the_demo_fails_when_the_job_failed(tmp_path):
    for r in (0, 1):
        (tmp_path / f"rank{r}.log").write_text("Traceback ...\nValueError: world size 4 is odd\n")
    opts = DemoOptions(steps=40)
    assert why_failed(_outcome(), opts, tmp_path) is None
    why = why_failed(_outcome(codes=[1, 1], steps=0), opts, tmp_path)
    assert why == (
        "ranks [0, 1] failed after 0 of 40 steps: ranks [0, 1] exited with code 1 "
        "(ValueError: world size 4 is odd)"
    )
    why = why_failed(_outcome(codes=[-9, 1], steps=7), opts, tmp_path)
    assert str(why).startswith(
        "ranks [0, 1] failed after 7 of 40 steps: rank 0 killed by SIGKILL; "
    )
    assert "ended after 12 of 40" in str(why_failed(_outcome(steps=12), opts, tmp_path))
    assert "did not end within" in str(why_failed(_outcome(ended="timeout"), opts, tmp_path))
    hang = [{"kind": "hang", "cause": "compute", "ranks": [1]}]
    assert "the healthy run got 1 verdict(s) (hang)" in str(
        why_failed(_outcome(verdicts=hang), opts, tmp_path)
    )


def test_the_demo_tells_the_errors_the_plugin_contained_in_each_process(tmp_path):
    # As a rank logs them: the first error of each place, then only counted.
    handler = logging.FileHandler(tmp_path / "rank2.log")
    ccld_log.addHandler(handler)
    try:
        for _ in range(2):
            report_error("test.demo_logs.round", ZeroDivisionError("division by zero"))
        report_error("test.demo_logs.sink", OSError("disk full"))
    finally:
        ccld_log.removeHandler(handler)
        handler.close()
    (tmp_path / "rank0.log").write_text("step 1\nstep 2\n")
    found = logged_errors(tmp_path)
    assert [line.split(":")[0] for line in found] == ["rank2", "rank2"]
    assert "contained error in test.demo_logs.round: ZeroDivisionError" in found[0]
    assert "test.demo_logs.sink: OSError: disk full" in found[1]
    assert logged_errors(tmp_path / "none") == []


def test_a_diagnosed_hang_explains_the_killed_ranks(tmp_path):
    fault = parse_fault("compute-hang@1:step=5")
    injected = [{"fault": str(fault), "kind": fault.kind, "rank": 1, "step": 5}]
    hang = {"kind": "hang", "cause": "compute", "ranks": [1], "detected_s": 1.0}
    diagnosed = [{"fault": str(fault), "verdict": True, "latency_s": None}]
    run = _outcome(
        faults=[fault],
        injected=injected,
        latency=diagnosed,
        verdicts=[hang],
        codes=[-15, -15],
        steps=5,
        ended="verdict",
    )
    assert why_failed(run, DemoOptions(steps=40), tmp_path) is None
    missed = [{"fault": str(fault), "verdict": False, "latency_s": None}]
    why = why_failed(
        _outcome(
            faults=[fault], injected=injected, latency=missed, steps=5, ended="timeout", codes=[-9]
        ),
        DemoOptions(steps=40),
        tmp_path,
    )
    assert "did not end within" in str(why) and "was not diagnosed" in str(why)


@pytest.mark.parametrize(
    "world, given, fitted",
    [
        (4, (None, None), (2, 2)),
        (8, (None, None), (2, 2)),
        (2, (None, None), (2, 1)),
        (6, (None, None), (2, 1)),
        (3, (None, None), (1, 1)),
        (1, (None, None), (1, 1)),
        (4, (1, None), (1, 2)),
        (4, (None, 4), (1, 4)),
        (8, (None, 2), (2, 2)),
        (4, (3, None), (3, 1)),  # kept as given: refused with the other options
    ],
)
def test_the_demo_fits_unset_sizes_to_the_world(world, given, fitted):
    assert fit_layout(world, *given) == fitted


def test_a_two_rank_demo_needs_no_sizes():
    # It gets as far as the fault's step, checked after the layout: nothing launched.
    out = subprocess.run(
        [sys.executable, "-m", "ccld_plugin.cli", "demo", "--framework", "torch"]
        + ["--world", "2", "--steps", "3", "--out", "/nonexistent/ccld-demo"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "fault compute-hang@1:step=5 starts at step 5, after the last step (2)" in line
