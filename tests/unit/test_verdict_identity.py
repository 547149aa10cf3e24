"""Schema 3's who and where: the JSON Schema that ships in the package describes the record
field for field; a finding's id is the same from any diagnoser of one run (a standby that
takes over) and a resumed verdict names the hang it ends; the culprits' local ranks and
devices come from what each rank published in the job's store; and the stall actions:
due after ``abort_after_s`` unless resumed, the exclude file, the abort record that every
rank's watch leaves on."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch.distributed as dist
from builders import group, job_view, rank_summary
from verdict_schema import VERDICT_SCHEMA

from ccld_plugin.config import ActionsConfig, ControlConfig, load_config
from ccld_plugin.control import ClockSync, ControlPlane
from ccld_plugin.diagnose.records import (
    RECORD_FIELDS,
    SCHEMA_FILE,
    Cause,
    Culprit,
    Device,
    Kind,
    Verdict,
)
from ccld_plugin.services.actions import ABORT_EXIT_CODE, AbortWatch, StallActions
from ccld_plugin.services.rank_services import store_job
from ccld_plugin.services.verdict_stamps import VerdictStamps, launcher_job

DP = group("dp", [0, 1, 2, 3])
WHEN = datetime(2026, 12, 7, 20, 5, 23, 123456, timezone.utc)


def _hang(ranks=(2,), cause=Cause.COMPUTE, trace="00000000000000ab:7") -> Verdict:
    return Verdict(
        kind=Kind.HANG,
        cause=cause,
        ranks=list(ranks),
        group=DP.to_dict(),
        op="all_reduce",
        trace_id=trace,
        step=5,
        onset_s=10.0,
        detected_s=14.0,
        severity=4.0,
    )


@pytest.fixture
def store():
    """A real TCPStore on loopback, and a control plane of a process outside the job
    over it (what ``ccld diagnoser`` uses), job ``j`` of 4 ranks."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    control = ControlPlane.client(ControlConfig(), "127.0.0.1", server.port, "j", 4)
    yield server, control


def test_the_json_schema_describes_the_record_field_for_field():
    schema = json.loads(SCHEMA_FILE.read_text())
    assert SCHEMA_FILE.parent.name == "diagnose"  # inside the package: it ships with it
    assert sorted(schema["properties"]) == sorted(RECORD_FIELDS) == sorted(schema["required"])
    assert schema["properties"]["schema"] == {"const": 3}


def test_a_stamped_record_of_each_kind_follows_the_schema_and_an_unstamped_does_not():
    kinds = {
        Kind.HANG: 4.0,
        Kind.SLOW: 1.6,
        Kind.RESUMED: 8.0,
        Kind.UNRESPONSIVE: 11.0,
        Kind.DEADLOCK: 5.0,
        Kind.MISMATCH: None,
        Kind.CRASH: None,
    }
    for kind, measure in kinds.items():
        v = replace(_hang(), kind=kind, severity=measure)
        assert not VERDICT_SCHEMA.is_valid(v.to_dict())  # no id, job, time yet
        v.stamp("4242", 1, WHEN, lambda r: Culprit(r, "node-7", r, Device(0, "GPU-a")))
        record = v.to_dict()
        assert list(VERDICT_SCHEMA.iter_errors(record)) == [], kind
        assert record["time"] == "2026-12-07T20:05:23.123Z" and record["job"] == "4242"
    # a slow verdict without its ratio, a hang without its seconds: not records of schema 3
    for kind in (Kind.SLOW, Kind.HANG):
        v = replace(_hang(), kind=kind, severity=None)
        v.stamp("4242", 1, WHEN)
        assert not VERDICT_SCHEMA.is_valid(v.to_dict())


def test_a_findings_id_is_the_same_from_any_diagnoser_of_a_run_and_resumed_names_it(store):
    _, control = store
    view = job_view([rank_summary(r, host=f"node-{r}") for r in range(4)], {})
    primary, standby = VerdictStamps(control, "j", 777), VerdictStamps(control, "j", 777)
    first, again = _hang(), _hang()
    primary.stamp([first], view)
    standby.stamp([again], view)  # the same hang, told by the standby after it took over
    assert first.id == again.id and len(first.id or "") == 16
    # ... but another finding has another: another run of the job (a restart), another
    # stall of the same rank (another op), another job
    other_run = _hang()
    VerdictStamps(control, "j", 778).stamp([other_run], view)
    later = _hang(trace="00000000000000ab:9")
    primary.stamp([later], view)
    other_job = _hang()
    VerdictStamps(control, "k", 777).stamp([other_job], view)
    assert len({first.id, other_run.id, later.id, other_job.id}) == 4
    # the hang's end: a resumed verdict of the same ranks, group and op
    back = replace(first, kind=Kind.RESUMED, severity=9.0)
    standby.stamp([back], view)
    assert back.resumes == first.id and back.id != first.id
    assert first.resumes is None


def test_culprits_are_where_their_ranks_said_they_run(store):
    _, control = store
    control.publish_who(2, {"local_rank": 2, "node": "n7", "device": {"index": 1, "uuid": "G"}})
    control.publish_who(3, {"local_rank": "x", "device": {"index": -1}})  # garbled: not shown
    view = job_view([rank_summary(r, host=f"node-{r}.cluster") for r in range(4)], {})
    stamps = VerdictStamps(control, "j", 1)
    v = _hang(ranks=(2, 3, 1))
    stamps.stamp([v], view)
    assert v.culprits == [
        Culprit(2, "node-2.cluster", 2, Device(1, "G")),
        Culprit(3, "node-3.cluster", None, None),
        Culprit(1, "node-1.cluster", None, None),  # published nothing
    ]
    # the exclude file takes the scheduler's name of the node where the rank said it
    assert [stamps.node(c) for c in v.culprits] == ["n7", "node-3.cluster", "node-1.cluster"]


def test_the_job_is_the_launchers_id(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's when given none
    assert launcher_job("job-29500") == "job-29500"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-5")
    assert launcher_job("job-29500") == "run-5"
    monkeypatch.setenv("SLURM_JOB_ID", "81234")
    assert launcher_job("job-29500") == "81234"


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _actions(tmp_path: Path, control, **cfg) -> tuple[StallActions, _Clock, list[float]]:
    clock, flushed = _Clock(), []
    cfg = {"exclude_file": str(tmp_path / "bad_hosts"), **cfg}
    actions = StallActions(
        ActionsConfig(**cfg), control, lambda c: c.host, flushed.append, clock=clock
    )
    return actions, clock, flushed


def _stamped(v: Verdict, hosts: dict[int, str]) -> Verdict:
    v.stamp("j", 1, WHEN, lambda r: Culprit(r, hosts.get(r)))
    return v


def test_a_stall_is_acted_on_once_it_stood_abort_after_s_unless_it_resumed(tmp_path, store):
    _, control = store
    actions, clock, flushed = _actions(tmp_path, control, on_hang="abort", abort_after_s=5.0)
    hosts = {2: "node-b", 1: "node-a"}
    checkpoint = _stamped(_hang(ranks=(1,), trace="00000000000000ab:3"), hosts)
    assert not actions.act([checkpoint])
    clock.t += 4
    back = _stamped(replace(checkpoint, kind=Kind.RESUMED, severity=4.5), hosts)
    assert not actions.act([back])  # it went on before abort_after_s: nothing done
    stuck = _stamped(_hang(), hosts)
    assert not actions.act([stuck]) and control.read_abort() is None
    clock.t += 4.9
    assert not actions.act([])
    clock.t += 0.2
    assert actions.act([])  # stood 5.1 s: the job is ended
    assert flushed == [5.0]  # the sinks were given their time first
    record = control.read_abort()
    assert record["id"] == stuck.id and "rank 2 on node-b in dp[0, 1, 2, 3]" in record["stall"]
    assert (tmp_path / "bad_hosts").read_text() == "node-b\n"  # not the resumed one's host
    assert not actions.act([_stamped(_hang(ranks=(3,)), {3: "node-c"})])  # once


def test_the_exclude_file_names_culprits_hosts_once_and_no_bystanders(tmp_path, store):
    _, control = store
    actions, _, _ = _actions(tmp_path, control)  # on_hang none: only the file
    (tmp_path / "bad_hosts").write_text("node-c\n")  # an earlier run's: rank 2's host
    hosts = {r: f"node-{'abcd'[r]}" for r in range(4)}
    stalls = [
        _stamped(_hang(ranks=(2,)), hosts),
        _stamped(_hang(ranks=(3,), cause=Cause.COMMUNICATION), hosts),
        # every member named: no culprit found, no host to leave out
        _stamped(_hang(ranks=(0, 1, 2, 3), cause=Cause.COMMUNICATION), hosts),
        _stamped(replace(_hang(ranks=(0,)), kind=Kind.MISMATCH, cause=Cause.SOFTWARE), hosts),
    ]
    assert not actions.act(stalls)
    assert (tmp_path / "bad_hosts").read_text() == "node-c\nnode-d\n"
    assert control.read_abort() is None


def test_every_ranks_watch_leaves_with_the_exit_code_on_the_abort_record(store):
    server, control = store
    exits: list[int] = []
    left = threading.Event()

    def exit_(code: int) -> None:
        exits.append(code)
        left.set()

    # the job's 4 ranks: each leaves once all have counted themselves out
    watches = [AbortWatch(control, 0.2, lambda: ClockSync(0, 0), exit=exit_) for _ in range(4)]
    for w in watches:
        w.start()
    assert not left.wait(0.5) and exits == []  # nothing posted: they watch on
    control.post_abort({"stall": "hang 0123456789abcdef: compute-bound, rank 2", "id": "x"})
    for w in watches:
        w._thread.join(timeout=5)
    assert exits == [ABORT_EXIT_CODE] * 4
    assert server.add("ccld/j//abort/left", 0) == 4  # (PrefixStore puts a / between)


def test_actions_config_is_checked():
    cfg = load_config(None, ["actions.on_hang=abort", "actions.abort_after_s=2.5"], writing=False)
    assert (cfg.actions.on_hang, cfg.actions.abort_after_s) == ("abort", 2.5)
    for bad in ("actions.on_hang=kill", "actions.abort_after_s=-1"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            load_config(None, [bad], writing=False)
    with pytest.raises(ValueError, match="sinks.webhook.url"):
        load_config(None, ["sinks.webhook.url=ftp://x/"], writing=False)


def test_a_restarted_attempt_has_store_keys_of_its_own(monkeypatch):
    # torchrun keeps the job's name and its store across restarts: the second attempt must
    # not read the first's abort record, reported findings or clock handshake
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert store_job("j") == "j"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert store_job("j") == "j"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert store_job("j") == "j/attempt1"
