"""The files a running job writes never end its training: a board folder that is full,
a link, another user's or another live job's turns the plugin off in the ranks concerned,
one line each, and training runs to its end; nothing is written through a link planted in
the job folder; another job's live boards are left as they are; and a config whose ranks
the job does not have stops before training, once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from job_runner import FAST, SCRIPTS, JobResult, run_job

from ccld_harness.launch import LocalJob, free_port
from ccld_plugin.board.reader import BoardReader
from ccld_plugin.config import load_config
from ccld_plugin.integrations.autostart import run_env
from ccld_plugin.sinks.jsonl import read_verdicts

CCLD = [sys.executable, "-m", "ccld_plugin.cli"]
OFF = "the plugin is off in this rank, training goes on"
TEARDOWN_ABORT = "terminate called without an active exception"


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mounts a tmpfs of a given size for the test (board.dir goes on it); a board takes 89
    pages (356 KiB) at its default size."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True
        )
        mounted.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


def _workload(out: Path, world: int, sets: list[str], steps: int = 3) -> JobResult:
    """The plain-PyTorch workload (``ccld_plugin.enable`` before ``init_process_group``),
    each rank's report in ``out / "reports"``."""
    args = ["--steps", str(steps), "--report-dir", str(out / "reports")]
    if world == 4:
        args += ["--tp", "2", "--pp", "2"]
    for s in sets:
        args += ["--ccld-set", s]
    return run_job("ccld_harness.workload", world, out, args=tuple(args))


def _trained(out: Path, world: int, steps: int) -> bool:
    reports = [out / "reports" / f"rank{r}.json" for r in range(world)]
    return all(
        f.exists() and len(json.loads(f.read_text())["step_times"]) == steps for f in reports
    )


def _as_ccld_run(sets: list[str], **extra: str) -> dict[str, str]:
    """A rank's environment as ``ccld run`` gives it (the plugin turned on at interpreter
    start, in an unchanged script), launched here as plain processes."""
    return {**run_env(load_config(None, sets), os.environ), "OMP_NUM_THREADS": "1", **extra}


def _lines(log: str, text: str) -> list[str]:
    return [line for line in log.splitlines() if text in line]


def _ddp_trained(result: JobResult, steps: int) -> None:
    """Every rank of ``ddp_plain.py`` ran its last step and exited 0 (or was aborted by
    gloo's teardown after it: torch's, with or without ccld; see the script)."""
    for r, (code, log) in enumerate(zip(result.codes, result.logs, strict=True)):
        last = log.rstrip().splitlines()[-1:]
        teardown = code == -signal.SIGABRT and last == [TEARDOWN_ABORT]
        assert f"step {steps - 1} " in log and (code == 0 or teardown), (r, code, log[-3000:])


def _no_traceback(result: JobResult) -> None:
    for r, log in enumerate(result.logs):
        assert "Traceback" not in log, f"rank {r}:\n{log[-3000:]}"


# ------------------------------------------------------------------ a full folder
def test_a_full_board_folder_turns_the_plugin_off_where_no_board_fits(tmp_path, tmpfs):
    # Four ranks, room for one board: without its pages reserved, each rank's board grows
    # as its ring fills, until the ranks die of SIGBUS.
    fs = tmpfs("480k")
    boards = fs / "b" / "j"
    sets = [f"board.dir={fs / 'b'}", "job=j", "board.cleanup=false"]
    result = _workload(tmp_path / "out", 4, sets, steps=20).check()
    assert _trained(tmp_path / "out", 4, 20)
    full = {
        r: _lines(log, "is full (no room for this rank's board)")
        for r, log in enumerate(result.logs)
    }
    off = sorted(r for r, lines in full.items() if lines)
    on = sorted(int(f.stem[4:]) for f in boards.glob("rank*.board"))
    assert off and sorted(on + off) == [0, 1, 2, 3], (on, off)
    for r in off:
        assert full[r] == [
            f"ccld: rank {r}: the board folder {boards} is full (no room for this rank's "
            f"board); {OFF}; free space there, or set board.dir to a folder with room"
        ]
    _no_traceback(result)


def _fill(folder: Path) -> None:
    """Take every free page of the filesystem of ``folder``."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def test_writes_to_a_full_folder_after_the_start_are_contained(tmp_path, tmpfs):
    """Once the boards are made, the folder fills: the stack file of a waiting rank, the
    verdicts file and the boards themselves (their pages reserved) go on without room."""
    fs = tmpfs("1m")
    boards = fs / "b" / "j"
    sets = [*FAST, f"board.dir={fs / 'b'}", "job=j", f"sinks.jsonl={fs / 'v.jsonl'}"]
    env = _as_ccld_run(sets, FAULT="stall@0:6:4", STEPS="40")
    job = LocalJob(world=2, argv=[str(SCRIPTS / "ddp_plain.py")], log_dir=tmp_path, env=env)
    job.start()
    try:
        deadline = time.monotonic() + 60
        wanted = [boards / "rank0.board", boards / "rank1.board", boards / "ccld-config.yaml"]
        while not all(p.exists() for p in wanted) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.exists() for p in wanted), [p for p in wanted if not p.exists()]
        _fill(fs)
        assert job.wait(120)
    finally:
        codes = job.stop()
    logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(2)]
    result = JobResult(codes, logs, tmp_path)
    _ddp_trained(result, 40)
    (stack,) = _lines(logs[1], "contained error in agent.stack_file")  # waiting for rank 0
    assert "No space left on device" in stack
    (jsonl,) = _lines(logs[0], "contained error in diagnoser.JsonlSink")  # its hang verdict
    assert "No space left on device" in jsonl
    _no_traceback(result)


# ------------------------------------------------------------------ unusable folders
def _link(path: Path, target: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


@pytest.mark.parametrize(
    "case", ["job folder a link", "user folder a link", "board.dir a link", "foreign", "a file"]
)
def test_an_unusable_board_folder_turns_the_plugin_off_with_one_line(tmp_path, case):
    uid = os.getuid()
    root, elsewhere = tmp_path / "boards", tmp_path / "elsewhere"
    board_dir, job_dir = f"{root}/ccld-{{uid}}", root / f"ccld-{uid}" / "j"
    if case == "job folder a link":
        _link(job_dir, elsewhere)
        expected = f"the job's board folder {job_dir} is a symbolic link to {elsewhere}"
    elif case == "user folder a link":
        _link(job_dir.parent, elsewhere)
        expected = f"board.dir {job_dir.parent} is a symbolic link to {elsewhere}"
    elif case == "board.dir a link":
        board_dir = str(root / "shared")
        _link(root / "shared", elsewhere)
        expected = f"board.dir {root / 'shared'} is a symbolic link to {elsewhere}"
    elif case == "foreign":  # another user's folder (as root: a folder given away)
        job_dir.mkdir(parents=True)
        os.chown(job_dir, 12345, 12345)
        expected = f"the board folder {job_dir} is owned by uid 12345, not by this user"
    else:
        job_dir.parent.mkdir(parents=True)
        job_dir.write_text("")
        expected = f"the job's board folder {job_dir} is not a folder"
    result = _workload(tmp_path / "out", 2, [f"board.dir={board_dir}", "job=j"]).check()
    assert _trained(tmp_path / "out", 2, 3)
    for r, log in enumerate(result.logs):
        (line,) = _lines(log, "ccld: ")
        assert line.startswith(f"ccld: rank {r}: {expected}") and OFF in line, line
    assert not elsewhere.exists() or list(elsewhere.iterdir()) == []
    _no_traceback(result)


# ------------------------------------------------------------------ links planted
def test_links_planted_in_the_job_folder_are_not_written_through(tmp_path):
    """The job's config and rank 1's stack (at the name its temporary file once had) are
    links to files of the user's: they stay as they were."""
    job_dir = tmp_path / "boards" / "j"
    job_dir.mkdir(parents=True)
    targets = {name: tmp_path / f"target-{name}" for name in ("config", "stack")}
    for t in targets.values():
        t.write_text("keep")
    (job_dir / "ccld-config.yaml").symlink_to(targets["config"])
    (job_dir / "rank1.stack.tmp").symlink_to(targets["stack"])
    verdicts = tmp_path / "v.jsonl"
    sets = [*FAST, f"board.dir={tmp_path / 'boards'}", "job=j", f"sinks.jsonl={verdicts}"]
    env = _as_ccld_run(sets, FAULT="stall@0:5:4", STEPS="20")
    result = run_job("ddp_plain.py", 2, tmp_path / "out", env=env)
    _ddp_trained(result, 20)
    # rank 1 waited for rank 0 long enough to be a hang: its stack was written meanwhile
    assert [v["kind"] for v in read_verdicts(verdicts)][:1] == ["hang"]
    assert all(t.read_text() == "keep" for t in targets.values())
    (config,) = _lines(result.logs[0], "ccld: ")
    assert (
        f"contained error in services.job_config: OSError: [Errno 40] is a symbolic link; "
        f"not written through it: '{job_dir / 'ccld-config.yaml'}'" in config
    )
    assert not _lines(result.logs[1], "ccld: ")
    _no_traceback(result)


def test_a_board_file_that_is_a_link_turns_the_plugin_off_in_its_rank(tmp_path):
    job_dir = tmp_path / "boards" / "j"
    job_dir.mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("keep")
    (job_dir / "rank1.board").symlink_to(target)
    result = _workload(tmp_path / "out", 2, [f"board.dir={tmp_path / 'boards'}", "job=j"]).check()
    assert _trained(tmp_path / "out", 2, 3) and target.read_text() == "keep"
    assert not _lines(result.logs[0], "ccld: ")
    assert _lines(result.logs[1], "ccld: ") == [
        f"ccld: rank 1: the board file {job_dir / 'rank1.board'} is a symbolic link; {OFF}; "
        "remove it"
    ]
    _no_traceback(result)


# ------------------------------------------------------------------ two jobs, one folder
def _start_background(job: LocalJob) -> threading.Thread:
    """Start ``job`` from a thread that lives as long as it (its ranks die with the thread
    that forked them)."""
    started = threading.Event()

    def run() -> None:
        job.start()
        started.set()
        job.wait(600)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(30)
    return thread


def _header(board: Path) -> tuple[int, int, int]:
    with BoardReader(board) as r:
        h = r.header()
        return h.pid, h.world, h.start_wall_ns


def test_a_folder_held_by_a_live_job_is_refused_and_its_boards_left_alone(tmp_path):
    """Job A (2 ranks) holds the folder, hung; job B of the same name (3 ranks) is refused
    on every rank and trains; A's boards are its own still. A killed with SIGKILL holds
    nothing: job C of the same name takes the folder over."""
    root = tmp_path / "boards"
    sets = [f"board.dir={root}", "job=j", "board.cleanup=false", "sinks.console=false"]
    a = LocalJob(
        world=2,
        argv=[str(SCRIPTS / "ddp_plain.py")],
        log_dir=tmp_path / "a",
        env=_as_ccld_run(sets, FAULT="hang@0:2", STEPS="40"),
    )
    _start_background(a)
    try:
        boards = [root / "j" / f"rank{r}.board" for r in range(2)]
        deadline = time.monotonic() + 60
        while not all(b.exists() for b in boards) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # A is training
        before = {b: (b.stat().st_ino, b.stat().st_size, _header(b)) for b in boards}
        pids = [p.pid for p in a.procs]
        assert [h[2][0] for h in before.values()] == pids
        b_env = _as_ccld_run(sets, STEPS="3")
        result = run_job("ddp_plain.py", 3, tmp_path / "b", env=b_env)
        _ddp_trained(result, 3)
        for r, log in enumerate(result.logs):
            (line,) = _lines(log, "ccld: ")
            assert line.startswith(
                f"ccld: rank {r}: the board folder {root / 'j'} is in use by another live job "
                f"(2 ranks, pids {pids[0]}, {pids[1]} on "
            ) and line.endswith(f"{OFF}; give this job another name (job=...) or board.dir")
        _no_traceback(result)
        assert {b: (b.stat().st_ino, b.stat().st_size, _header(b)) for b in boards} == before
        assert not (root / "j" / "rank2.board").exists()
    finally:
        for p in a.procs:
            os.killpg(p.pid, signal.SIGKILL)
        a.stop()
    c = run_job("ddp_plain.py", 2, tmp_path / "c", env=_as_ccld_run(sets, STEPS="3"))
    _ddp_trained(c, 3)
    assert not any(_lines(log, "ccld: ") for log in c.logs), c.logs
    assert [_header(b)[0] for b in boards] != [h[2][0] for h in before.values()]


# ------------------------------------------------------------------ ranks the job lacks
# (deepspeed's launcher passes --local_rank=N first: the marker's path is in the environment)
MARKER_SCRIPT = "import os, pathlib\npathlib.Path(os.environ['MARKER']).write_text('ran')\n"


def _torchrun(*options: str) -> list[str]:
    port = free_port()
    where = ["--rdzv-endpoint", f"127.0.0.1:{port}", "--master-port", str(port)]
    return [sys.executable, "-m", "torch.distributed.run", *options, *where]


@pytest.mark.parametrize(
    "sets, launcher, said",
    [
        (
            ["diagnoser.rank=5"],
            _torchrun("--nproc-per-node", "2"),
            "diagnoser.rank=5 is not a rank of this job of 2 ranks (python -m "
            "torch.distributed.run --nproc-per-node 2 --nnodes 1); expected 0..1",
        ),
        (
            ["diagnoser.rank=3"],
            _torchrun("--nproc_per_node=2", "--nnodes", "1:2", "--rdzv-backend", "c10d"),
            "diagnoser.rank=3 is not a rank of this job of 2 ranks (python -m "
            "torch.distributed.run --nproc-per-node 2 --nnodes 1:2 at its fewest)",
        ),
        (
            ["diagnoser.standby_rank=4"],
            _torchrun("--nproc-per-node", "4"),
            "diagnoser.standby_rank=4 is not a rank of this job of 4 ranks",
        ),
        (
            ["diagnoser.rank=2"],
            [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2"],
            "diagnoser.rank=2 is not a rank of this job of 2 ranks (deepspeed --num_gpus 2 on "
            "this machine)",
        ),
    ],
)
def test_ccld_run_refuses_ranks_the_launch_lacks_before_launching(tmp_path, sets, launcher, said):
    script, marker = tmp_path / "script.py", tmp_path / "ran"
    script.write_text(MARKER_SCRIPT)
    cmd = [*CCLD, "run", *sum((["--set", s] for s in sets), []), "--", *launcher]
    env = {**os.environ, "MARKER": str(marker)}
    out = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stdout == "" and not marker.exists(), out
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"ccld: error: ccld config: {said}"), line


@pytest.mark.parametrize(
    "how, world, rank_key",
    [
        ("ccld run's environment, plain python", 2, "diagnoser.rank=5"),
        ("enable() before init_process_group", 3, "diagnoser.standby_rank=3"),
        ("enable() after the first collectives", 4, "diagnoser.rank=4"),
    ],
)
def test_ranks_the_job_lacks_stop_every_rank_with_code_2_and_one_line(
    tmp_path, how, world, rank_key
):
    out = tmp_path / "out"
    if how.startswith("ccld run"):
        result = run_job("ddp_plain.py", world, out, env=_as_ccld_run([rank_key], STEPS="3"))
    elif how.startswith("enable() before"):
        args = ("--steps", "3", "--ccld-set", rank_key, "--report-dir", str(out / "reports"))
        result = run_job("ccld_harness.workload", world, out, args=args)
    else:
        result = run_job("enable_after_init.py", world, out, args=(rank_key,))
    assert result.codes == [2] * world, (result.codes, result.logs)
    key, value = rank_key.split("=")
    expected = (
        f"ccld: error: ccld config: {key}={value} is not a rank of this job of {world} ranks; "
        f"expected 0..{world - 1}"
    )
    (line,) = _lines(result.logs[0], "ccld: ")
    assert line.startswith(expected) and line.endswith("every rank of the job exits with code 2")
    for r, log in enumerate(result.logs):
        assert r == 0 or not _lines(log, "ccld: "), log
        assert not _lines(log, "step "), log  # before the first step
    assert not (out / "reports").exists()
    _no_traceback(result)
