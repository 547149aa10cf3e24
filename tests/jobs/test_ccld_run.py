"""``ccld run``: the plugin turned on in every rank of unchanged scripts (plain DDP, a 2-D
named DeviceMesh) launched by torchrun, with a compute hang or a straggler in each."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from job_runner import FAST, SCRIPTS, board_roles, facts

from ccld_harness.launch import free_port
from ccld_plugin.board.reader import BoardReader, board_files
from ccld_plugin.cli import main
from ccld_plugin.sinks.jsonl import read_verdicts
from ccld_plugin.wire.codes import OP_NAMES

CCLD = [sys.executable, "-m", "ccld_plugin.cli"]
TERMINAL = {"hang", "deadlock", "mismatch", "unresponsive", "crash"}


def _torchrun(world: int) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    return [*launch, "--master-addr", "127.0.0.1", "--master-port", str(free_port())]


def _deepspeed(world: int) -> list[str]:
    """The deepspeed launcher (its runner, then one launch process that starts the ranks)."""
    runner = Path(sys.executable).parent / "deepspeed"
    return [str(runner), "--num_gpus", str(world), "--master_port", str(free_port())]


def _env(fault: str, steps: int) -> dict[str, str]:
    return {**os.environ, "FAULT": fault, "STEPS": str(steps), "OMP_NUM_THREADS": "1"}


def ccld_run(
    tmp: Path,
    script: str,
    fault: str,
    steps: int,
    timeout_s: float = 180,
    world: int = 4,
    launcher=_torchrun,
    cleanup: bool = False,
    end_on_verdict: bool = True,
    sets: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    until: Callable[[list[dict]], bool] | None = None,
) -> list[dict]:
    """Run ``script`` on ``world`` ranks under ``ccld run -- <launcher>`` (default
    ``python -m torch.distributed.run``); a hung job is ended once a verdict says it will
    not recover (unless not ``end_on_verdict``: it runs to its end). Its verdicts; its boards
    in ``tmp / "j"`` (all kept unless ``cleanup``). ``sets``: more config overrides;
    ``env``: more environment for the job; ``until``: asked with the verdicts so far while
    the job runs, whether to end it now (instead of on a verdict it will not recover from)."""
    sets = (*FAST, f"board.dir={tmp}", "job=j", f"board.cleanup={str(cleanup).lower()}", *sets)
    sets += (f"sinks.jsonl={tmp / 'verdicts.jsonl'}", "sinks.console=false")
    cmd = [*CCLD, "run", *sum((["--set", s] for s in sets), []), "--", *launcher(world)]
    env = {**_env(fault, steps), **(env or {})}
    # DeepSpeed on a CPU: its CPU accelerator, and no torch.compile import
    env.update(DS_ACCELERATOR="cpu", TORCHDYNAMO_DISABLE="1")
    # the deepspeed runner finds the Python that runs the ranks on PATH
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = open(tmp / "job.log", "wb")  # noqa: SIM115 - the job's
    proc = subprocess.Popen(
        [*cmd, str(SCRIPTS / script)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            verdicts = read_verdicts(tmp / "verdicts.jsonl")
            if until is not None and until(verdicts):
                break
            if until is None and end_on_verdict and any(v["kind"] in TERMINAL for v in verdicts):
                time.sleep(1)
                break
            time.sleep(0.3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun ends its workers
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        log.close()
    # the plugin's native objects are freed before the interpreter exits (a reference
    # cycle once kept the board alive, and nanobind printed leaks at every exit)
    assert "nanobind: leaked" not in (tmp / "job.log").read_text(errors="replace")
    return read_verdicts(tmp / "verdicts.jsonl")


def _log(tmp: Path) -> str:
    return (tmp / "job.log").read_text(errors="replace")[-3000:]


def test_ddp_compute_hang(tmp_path):
    verdicts = ccld_run(tmp_path, "ddp_plain.py", "hang@2:5", 60)
    assert len(verdicts) == 1, (verdicts, _log(tmp_path))
    (v,) = verdicts
    assert (v["kind"], v["cause"], v["ranks"]) == ("hang", "compute", [2])
    assert v["group"] == {**v["group"], "role": "dp", "ranks": [0, 1, 2, 3]}  # DDP's group
    assert v["step"] == 5  # steps marked from the optimizer step hook
    stack = v["stack"] or []  # where it is stuck: the fault, called from the script's loop
    assert any("script_faults.py" in f and "in fault" in f for f in stack), stack
    assert any("ddp_plain.py" in f and "in main" in f for f in stack), stack


def test_ddp_rank_that_stalls_and_goes_on_is_a_hang_then_resumed(tmp_path):
    # Rank 0 stops 8 s at step 8 (a checkpoint of its own, past the 3 s floor), the others
    # waiting in DDP's all-reduce; then the job runs to its end.
    verdicts = ccld_run(tmp_path, "ddp_plain.py", "stall@0:8:8", 60, end_on_verdict=False)
    assert [(v["kind"], v["cause"], v["ranks"]) for v in verdicts] == [
        ("hang", "compute", [0]),
        ("resumed", "compute", [0]),
    ], (verdicts, _log(tmp_path))
    hang, back = verdicts
    assert back["group"] == hang["group"] and hang["step"] == 8 and back["step"] >= 9
    assert 7 <= back["lasted_s"] <= 10  # the stall's length, seconds
    assert "step 59" in _log(tmp_path)


def test_ddp_straggler(tmp_path):
    """The peers wait for the straggler in the last bucket's all-reduce of each backward
    (in the comm hook ``ccld run`` gives DDP): that wait is blocked time, not compute."""
    verdicts = ccld_run(tmp_path, "ddp_plain.py", "slow@1:0.15", 60)
    slow = [v for v in verdicts if v["kind"] == "slow"]
    assert slow and (slow[0]["cause"], slow[0]["ranks"]) == ("compute", [1]), (
        verdicts,
        _log(tmp_path),
    )
    assert slow[0]["group"]["role"] == "dp"
    assert not [v for v in verdicts if v["kind"] != "slow" or v["ranks"] != [1]]


def _params_digest(log: str) -> str:
    # the ranks share one stdout: another rank's line may run on right after the digest
    (digest,) = re.findall(r"params ([0-9a-f]{64})", log)
    return digest


def test_ddp_numerics_unchanged(tmp_path):
    """The same parameters after 8 steps with and without ``ccld run``, bit for bit, on 3
    ranks (1/3 is inexact: scaling by 1/world, as DDP does, and dividing by world, as
    PyTorch's allreduce_hook does, round differently); and the buckets went through the
    tracer: all-reduces on DDP's group, every step."""
    script = str(SCRIPTS / "ddp_plain.py")
    plain = subprocess.run(
        [*_torchrun(3), script], env=_env("", 8), capture_output=True, text=True, timeout=180
    )
    # gloo can still abort a rank at teardown, after training and the digest ("terminate
    # called without an active exception": torch's, with or without ccld; see the script;
    # a fresh-clone CI run hit it in this reference run): the digest is what is compared.
    teardown_abort = "terminate called without an active exception" in plain.stderr
    assert plain.returncode == 0 or teardown_abort, plain.stdout[-3000:] + plain.stderr[-3000:]
    assert ccld_run(tmp_path, "ddp_plain.py", "", 8, world=3) == []
    assert _params_digest((tmp_path / "job.log").read_text()) == _params_digest(plain.stdout)
    for f in board_files(tmp_path / "j"):
        with BoardReader(f) as r:
            dp = {g.group_id for g in r.groups() if g.role == "dp"}
            steps = {
                int(o["step"])
                for o in r.ops()
                if OP_NAMES[int(o["op"])] == "all_reduce" and int(o["group_id"]) in dp
            }
        assert steps >= set(range(1, 8)), (f, steps)


def test_device_mesh_compute_hang_with_named_roles(tmp_path):
    verdicts = ccld_run(tmp_path, "mesh_2d.py", "hang@2:5", 60)
    assert len(verdicts) == 1, (verdicts, _log(tmp_path))
    (v,) = verdicts
    assert (v["kind"], v["cause"], v["ranks"]) == ("hang", "compute", [2])
    assert v["group"]["role"] in ("tp", "dp") and 2 in v["group"]["ranks"]
    assert v["step"] == 5
    assert board_roles(tmp_path / "j") == {r: {"world", "dp", "tp"} for r in range(4)}


def test_device_mesh_straggler(tmp_path):
    verdicts = ccld_run(tmp_path, "mesh_2d.py", "slow@3:0.15", 60)
    slow = [v for v in verdicts if v["kind"] == "slow"]
    assert slow and (slow[0]["cause"], slow[0]["ranks"]) == ("compute", [3]), (
        verdicts,
        _log(tmp_path),
    )
    assert slow[0]["group"]["role"] in ("tp", "dp")


def test_dtensor_tensor_parallel_compute_hang_is_named_in_its_tp_group(tmp_path):
    # DTensor's all-reduces (functional collectives) reach gloo from C++, past the wrapped
    # torch.distributed functions: unseen, rank 1's TP peer would wait in one and the hang
    # be named on rank 0 (in no collective as far as its board showed), each in its DP
    # pair. The tracer puts them on the board, with one trace id on both members.
    (v,) = [v for v in ccld_run(tmp_path, "dtensor_tp.py", "hang@1:6", 30)]
    assert (v["kind"], v["cause"], v["ranks"], v["op"]) == ("hang", "compute", [1], "all_reduce")
    assert (v["group"]["role"], v["group"]["ranks"]) == ("tp", [0, 1])
    (ev,) = facts(v["evidence"])["not_entered"]
    assert ev["data"]["waiting"] == [0] and ev["data"]["role"] == "tp"
    assert "contained error" not in _log(tmp_path)  # DTensor's sliced meshes: no groups


def test_pipeline_on_the_world_group_healthy_gets_no_verdict(tmp_path):
    # torch.distributed.pipelining, a stage per rank, no group to tell the stages apart:
    # compared as one cohort, the middle stages (more work than the first and last) were
    # named stragglers of healthy runs. Each stage is judged by its own change.
    assert ccld_run(tmp_path, "pipeline_gpipe.py", "", 400) == []


@pytest.mark.parametrize(
    ("fault", "kind", "rank"), [("hang@1:6", "hang", 1), ("slow@2:0.01:20", "slow", 2)]
)
def test_pipeline_on_the_world_group_stage_faults(tmp_path, fault, kind, rank):
    verdicts = ccld_run(tmp_path, "pipeline_gpipe.py", fault, 30 if kind == "hang" else 120)
    assert [(v["kind"], v["cause"], v["ranks"]) for v in verdicts] == [(kind, "compute", [rank])], (
        verdicts,
        _log(tmp_path),
    )
    assert verdicts[0]["group"]["role"] == "world"
    if kind == "slow":  # a stage slow from step 20, 4x its 3 ms: named within 15 steps
        assert verdicts[0]["step"] <= 35


def test_device_mesh_rank_that_skipped_a_collective_is_named_after_the_job_died(tmp_path):
    # Rank 1 leaves out one DP all-reduce: gloo pairs its later ones with rank 3's earlier
    # ones, and the job runs on a step out until rank 1 ends its loop and leaves, one
    # all-reduce short, while rank 3 waits in its last; rank 3 raises (the connection
    # closed) and torchrun ends the job. From the boards: rank 1 left short of it.
    live = ccld_run(tmp_path, "mesh_2d.py", "skip@1:5", 20)
    assert all(v["kind"] == "mismatch" and v["ranks"] == [1] for v in live), live
    out = tmp_path / "pm.jsonl"
    assert main(["diagnose", str(tmp_path / "j"), "--jsonl", str(out)]) == 0
    (v,) = read_verdicts(out)
    assert (v["kind"], v["cause"], v["ranks"], v["op"]) == (
        "mismatch",
        "software",
        [1],
        "all_reduce",
    )
    assert (v["group"]["role"], v["group"]["ranks"]) == ("dp", [1, 3])
    assert facts(v["evidence"])["left_early"][0]["data"]["entered"] == 19


def _crash_of_rank_2_at_step_6(tmp: Path, fault: str) -> dict:
    """Run mesh_2d.py with ``fault``; assert the one live verdict and the one from the
    boards are a crash of rank 2 (at step 6), and return the latter."""
    live = ccld_run(tmp, "mesh_2d.py", fault, 30)
    assert [(v["kind"], v["cause"], v["ranks"]) for v in live] == [("crash", "software", [2])]
    out = tmp / "pm.jsonl"
    assert main(["diagnose", str(tmp / "j"), "--jsonl", str(out)]) == 0
    (v,) = read_verdicts(out)
    assert (v["kind"], v["ranks"], v["step"]) == ("crash", [2], 6)
    return v


def test_device_mesh_rank_that_crashed_is_named_not_the_ranks_torchrun_ended(tmp_path):
    # Rank 2 raises an exception it does not catch: Python's exit path runs (the plugin
    # records the exception), its peers' collectives raise as its connections close, and
    # torchrun ends the rest with SIGTERM. One finding, live and from the boards: rank 2.
    v = _crash_of_rank_2_at_step_6(tmp_path, "crash@2:6")
    (ev,) = facts(v["evidence"])["exception"]
    assert ev["data"]["exception"] == "MemoryError: out of memory (a test script's crash)"
    assert "script_faults.py" in ev["data"]["where"] and "in fault" in ev["data"]["where"]
    assert any("mesh_2d.py" in f and "in main" in f for f in v["stack"])


def test_device_mesh_collective_that_raised_on_its_caller_is_its_crash(tmp_path):
    # Rank 2 calls an all-gather with an output of the wrong size: gloo raises on rank 2
    # alone, its TP peer waits in the all-reduce, and every other rank's op raises once
    # rank 2's connections close. Each rank left on an exception out of an op; the first
    # that was not a peer's failure is named, and its call is not also a mismatch.
    v = _crash_of_rank_2_at_step_6(tmp_path, "misuse@2:6")
    (ev,) = facts(v["evidence"])["exception"]
    assert "invalid tensor size" in ev["data"]["exception"]
    assert "mesh_2d.py" in ev["data"]["where"]  # the call, not torch's frame
    (at,) = facts(v["evidence"])["crashed_at"]
    assert (at["data"]["op"], at["data"]["role"]) == ("all_gather_into_tensor", "tp")


def test_ranks_whose_collective_raised_keep_their_boards_however_they_exit(tmp_path):
    # Every rank of this script leaves a failed step by sys.exit(1): rank 1 on its own
    # error at step 6, ranks 0 and 2 on the all-reduce that raised when rank 1's
    # connections closed. Python ends such a process as cleanly as a finished one, and
    # every board was removed (the diagnoser's rank ended too, often before its round):
    # nothing was left to diagnose. The ranks that saw a collective raise keep theirs.
    ccld_run(tmp_path, "exit_on_error.py", "crash@1:6", 40, world=3, cleanup=True)
    log = (tmp_path / "job.log").read_text(errors="replace")
    assert "rank 1: training failed: MemoryError" in log, log[-3000:]
    kept = sorted(p.name for p in (tmp_path / "j").glob("*.board"))
    assert kept == ["rank0.board", "rank2.board"], (kept, log[-3000:])
    # From them, the post-mortem points at the rank that left no board.
    out = subprocess.run([*CCLD, "diagnose", str(tmp_path / "j")], capture_output=True, text=True)
    text = " ".join((out.stdout + out.stderr).split())
    assert "2 of 3 boards" in text, text
    assert "rank(s) [0, 2] raised, in ops with rank(s) [1], which left no board" in text, text


def test_deepspeed_launcher_compute_hang(tmp_path):
    """An unchanged DeepSpeed script under the deepspeed launcher: its groups get their roles
    at deepspeed.initialize, its steps come from the optimizer step hook."""
    verdicts = ccld_run(tmp_path, "ds_plain.py", "hang@1:6", 60, timeout_s=240, launcher=_deepspeed)
    assert len(verdicts) == 1, (verdicts, _log(tmp_path))
    (v,) = verdicts
    assert (v["kind"], v["cause"], v["ranks"]) == ("hang", "compute", [1])
    assert v["group"] == {**v["group"], "role": "dp", "ranks": [0, 1, 2, 3]}
    assert v["step"] == 6
    assert any("ds_plain.py" in f and "in main" in f for f in v["stack"] or []), v["stack"]


PROBE = (
    "import os, sys; print(sorted((k, v) for k, v in os.environ.items() if k != '_'));"
    "print(sorted(m for m in sys.modules if m.startswith('ccld') or m == 'sitecustomize'))"
)


def test_disabled_changes_nothing(tmp_path):
    plain = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    off = subprocess.run(
        [*CCLD, "run", "--set", "enabled=false", "--", sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
    )
    assert off.returncode == plain.returncode == 0 and off.stdout == plain.stdout


def test_bad_setting_stops_before_launching(tmp_path):
    marker = tmp_path / "ran"
    bad = subprocess.run(
        [*CCLD, "run", "--set", "agent.interval_s=0", "--", "touch", str(marker)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and not marker.exists()
    assert bad.stderr.count("\n") == 1 and "agent.interval_s=0" in bad.stderr


@pytest.mark.parametrize("existing", [True, False])
def test_existing_sitecustomize_still_runs(tmp_path, existing):
    if existing:
        (tmp_path / "sitecustomize.py").write_text("import os; os.environ['THEIRS'] = '1'\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "RANK": "0"}
    probe = "import os, sys; print(os.environ.get('THEIRS'), 'ccld_plugin' in sys.modules)"
    out = subprocess.run(
        [*CCLD, "run", "--", sys.executable, "-c", probe], capture_output=True, text=True, env=env
    )
    assert out.stdout.split() == ["1" if existing else "None", "True"], out.stderr
