"""The W&B diagnosis panels.

Real jobs and a real wandb (offline): a hung demo job logs into a run of the sink's own,
and the run file is read back with the plugin's own reader, its timeline file beside it;
the same job with wandb made unimportable still diagnoses; panels go into a user's
existing run without disturbing its steps. The panel numbers themselves are checked on
synthetic views.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_runner import demo
from trace_rules import check_trace
from wandb_views import job_views, joined_samples, slow_link_verdict

from ccld_plugin.config import DiagnoserConfig, load_config
from ccld_plugin.diagnose import Analyzer
from ccld_plugin.diagnose.arrivals import JoinedTable
from ccld_plugin.errors import contained_errors
from ccld_plugin.sinks import build_sinks
from ccld_plugin.sinks.jsonl import read_verdicts
from ccld_plugin.sinks.wandb.backends import WriterProcess
from ccld_plugin.sinks.wandb.run_file import find_run_files, iter_records, wait_for_run
from ccld_plugin.sinks.wandb.sink import WandbSink
from ccld_plugin.sinks.wandb.verdicts import VERDICT_COLUMNS, verdict_row

PER_STEP = [
    "step_ms",
    "compute_ms",
    "compute_max_ms",
    "blocked_dp_ms",
    "slowest_rank",
    "slowest_ratio",
]
S, MS = 1_000_000_000, 1_000_000


# The hang comes after a few steps with arrival samples in them: a step's skew panel shows
# only samples joined before its row is written (one CI run of a hang at step 4 had none).
HANG_STEP = 8


def _demo(out: Path, extra: list[str]) -> int:
    """A 4-rank DP job whose rank 2 hangs at HANG_STEP, with the W&B sink on."""
    code, _ = demo(
        out,
        f"compute-hang@2:step={HANG_STEP}",
        framework="torch",
        world=4,
        tp=1,
        pp=1,
        steps=40,
        extra=("sinks.wandb.enabled=true", *extra),
        timeout_s=120,
    )
    return code


# ---------------------------------------------------------------------- real jobs
def test_hung_job_logs_panels_verdict_and_alert_to_an_offline_run(tmp_path):
    out = tmp_path / "out"
    started = time.time()
    assert _demo(out, [f"sinks.wandb.dir={out / 'wandb'}"]) == 0
    # The job was killed (it hung); the writer process finishes the run on its own.
    run = wait_for_run(out / "wandb", timeout_s=60, since=started - 1)
    assert run is not None and run.finished, run
    for key in PER_STEP:
        assert run.points.get(f"ccld/per_step/{key}", 0) >= 3, (key, sorted(run.points))
    assert run.points["ccld/step"] >= 3
    # Arrival skew and bandwidth come from sampled collectives (every 4th of a group).
    assert run.points.get("ccld/per_step/skew_ms", 0) >= 1
    # The hang watch kept climbing after the steps stopped, past the 3 s threshold.
    assert max(run.values["ccld/hang/oldest_op_age_s"]) >= 3
    assert run.values["ccld/hang/threshold_s"][-1] >= 3
    assert "ccld/heatmap/compute" in run.points
    assert run.charts.get("ccld/ranks/compute_bar") == "wandb/bar/v0"
    ranks = run.tables["ccld/ranks/table"]
    assert [row[0] for row in ranks.rows] == [0, 1, 2, 3]

    table = run.tables["ccld/verdicts/table"]
    assert table.columns == VERDICT_COLUMNS
    rows = [dict(zip(table.columns, r, strict=True)) for r in table.rows]
    (hang,) = [r for r in rows if r["kind"] == "hang"]
    assert (json.loads(hang["ranks"]), hang["cause"], hang["group_role"]) == ([2], "compute", "dp")
    assert json.loads(hang["group_ranks"]) == [0, 1, 2, 3] and hang["op"] == "all_reduce"
    (alert,) = [a for a in run.alerts if "hang" in a["title"]]
    assert alert["title"] == "ccld hang: rank 2 (compute)" and alert["level"] == "ERROR"
    assert "rank 2 in dp[0, 1, 2, 3]" in alert["text"]
    # The same verdict as the JSONL sink wrote, who and where included.
    (v,) = [x for x in read_verdicts(out / "verdicts.jsonl") if x["kind"] == "hang"]
    assert verdict_row(v) == table.rows[rows.index(hang)]
    where = f"rank 2 on {socket.gethostname()} (local rank 2)"
    assert hang["culprits"] == where and (hang["id"], hang["job"]) == (v["id"], v["job"])
    assert hang["stuck_s"] == v["stuck_s"] >= 3 and hang["time"] == v["time"]
    assert where in alert["text"] and f"id {v['id']}" in alert["text"]

    # The timeline, made from the boards the killed job left and saved with the run.
    trace = run.run_dir / "files" / "ccld_trace.json"
    by_ph = check_trace(json.loads(trace.read_text()))
    tracks = {(e["pid"], e["args"]["name"]) for e in by_ph["M"] if e["name"] == "thread_name"}
    assert {pid for pid, _ in tracks} == {0, 1, 2, 3}
    assert all((pid, "steps") in tracks for pid in range(4))
    assert all((pid, "dp[0, 1, 2, 3]") in tracks for pid in range(4))
    # The run's verdict, on the hung rank's dp track, at the hung collective.
    (mark,) = [e for e in by_ph["i"] if e["name"] == "hang (compute)"]
    assert mark["pid"] == 2 and mark["args"]["trace_id"] == v["trace_id"]
    hung = [e for e in by_ph["X"] if e["args"].get("trace_id") == v["trace_id"]]
    assert sorted(e["pid"] for e in hung) == [0, 1, 3]  # rank 2 never entered it
    assert {e["args"]["state"] for e in hung} == {"in_flight"}
    # Rank 2 marked its step and hung in compute before its first op: the step still shows,
    # reaching past the moment its peers entered the collective it never came to.
    (stuck,) = [e for e in by_ph["X"] if e["pid"] == 2 and e["name"] == f"step {HANG_STEP}"]
    assert stuck["ts"] + stuck["dur"] > max(e["ts"] for e in hung)


BLOCKER = '''\
"""Makes wandb unimportable in every process of the job, as if it were not installed:
a meta-path finder ahead of the normal ones answers every wandb module with the error
the import system raises for a missing module."""
import sys


class _NoWandb:
    def find_spec(self, name, path=None, target=None):
        if name == "wandb" or name.startswith("wandb."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoWandb())
'''


def test_job_without_wandb_still_runs_and_diagnoses(tmp_path, monkeypatch):
    """wandb is installed here, so its absence is simulated: a sitecustomize on the job's
    PYTHONPATH (inherited by every rank) puts a meta-path finder first that raises
    ModuleNotFoundError for wandb, exactly what ``import wandb`` raises when it is not
    installed. The first check proves the blocker works in a fresh interpreter."""
    blocker = tmp_path / "no_wandb"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    probe = subprocess.run([sys.executable, "-c", "import wandb"], capture_output=True, text=True)
    assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr

    out = tmp_path / "out"
    assert _demo(out, [f"sinks.wandb.dir={out / 'wandb'}"]) == 0
    (v,) = [x for x in read_verdicts(out / "verdicts.jsonl") if x["kind"] == "hang"]
    assert (v["ranks"], v["cause"]) == ([2], "compute")
    log = (out / "logs" / "rank0.log").read_text()
    lines = [ln for ln in log.splitlines() if "contained error in sinks.wandb" in ln]
    assert len(lines) == 1, log[-3000:]
    assert "ModuleNotFoundError: No module named 'wandb'" in lines[0]
    assert "training continues" in lines[0]
    assert not (out / "wandb").exists()


def test_broken_wandb_in_the_writer_process_is_contained(tmp_path, monkeypatch):
    """A wandb that is found but fails to import (a broken install): the writer process
    reports it and the sink says so once, without raising."""
    stub = tmp_path / "stub" / "wandb"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('broken wandb install')\n")
    monkeypatch.setenv("PYTHONPATH", str(stub.parent))
    before = contained_errors().get("sinks.wandb", 0)
    writer = WriterProcess({"project": "p", "mode": "offline"}, sys.executable)
    assert writer.proc.wait(timeout=30) == 1
    writer._status.join(timeout=10)
    assert writer.failure and "ImportError: broken wandb install" in writer.failure
    assert contained_errors()["sinks.wandb"] == before + 1
    with pytest.raises(RuntimeError, match="broken wandb install"):
        writer.send([{"op": "log", "data": {}}])


def test_a_timeline_that_cannot_be_made_is_contained(tmp_path):
    """Boards that ``ccld trace`` cannot read (a torn file): the writer still finishes the
    run, and the sink says why there is no timeline, once."""
    boards = tmp_path / "boards"
    boards.mkdir()
    (boards / "rank0.board").write_bytes(b"not a board")
    before = contained_errors().get("sinks.wandb.timeline", 0)
    writer = WriterProcess(
        {"project": "p", "mode": "offline", "dir": str(tmp_path / "wandb")}, sys.executable
    )
    writer.send([{"op": "timeline", "boards": str(boards), "python": sys.executable}])
    writer.close(wait_s=60)
    writer._status.join(timeout=10)
    assert writer.proc.returncode == 0
    assert contained_errors()["sinks.wandb.timeline"] == before + 1
    run = wait_for_run(tmp_path / "wandb", timeout_s=30)
    assert run is not None and run.finished
    assert not (run.run_dir / "files" / "ccld_trace.json").exists()


def test_panels_go_into_the_users_existing_run(tmp_path):
    """A user's run (as Megatron's or DeepSpeed's writer makes): the sink logs into it,
    never advances its step, leaves it open at close, and the user's own explicit-step
    logging loses nothing."""
    import wandb

    run = wandb.init(
        project="user",
        mode="offline",
        dir=str(tmp_path),
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
    )
    assert wandb.run is run
    try:
        (sink,) = build_sinks(
            load_config(
                None,
                [
                    "sinks.console=false",
                    "sinks.wandb.enabled=true",
                    "sinks.wandb.log_interval_steps=2",
                ],
            ).sinks
        )
        assert isinstance(sink, WandbSink)
        diag = Analyzer(DiagnoserConfig(), 0.5)
        for step in range(6):
            run.log({"loss": 1.0 / (step + 1)}, step=step)
            views = job_views(steps=1, first=step)
            diag.slow.keep_joined(JoinedTable.of(joined_samples(step)))
            sink.observe(views[-1], diag)
        sink.emit(slow_link_verdict())
        sink.close()
        assert wandb.run is run  # still the user's, still open
        run.log({"loss": 0.01}, step=6)
        # A user's record too long for one 32 KiB block: the reader must join its chunks.
        run.log({"notes": "x" * 70_000}, step=7, commit=True)
    finally:
        run.finish()
    (path,) = find_run_files(tmp_path)
    # finish() can return before wandb's service has written the file's last block.
    got = wait_for_run(tmp_path, timeout_s=30)
    assert got is not None and got.finished and got.file == path
    assert got.points["loss"] == 7 and got.values["loss"][-1] == 0.01
    assert len(got.values["notes"][0]) == 70_000
    assert got.points.get("ccld/per_step/compute_ms", 0) >= 1
    assert (
        got.tables["ccld/verdicts/table"].rows[0][VERDICT_COLUMNS.index("cause")] == "communication"
    )
    assert [a["title"] for a in got.alerts] == ["ccld slow: rank 3 (communication)"]
    assert len(list(iter_records(path))) == got.records
