"""The wheel as a user gets it (``make wheel-check``, run by CI): built from this checkout,
installed into a fresh virtual environment in a temporary folder (torch first, the pinned
CPU build), and used from another folder with no source tree on the path: ``ccld demo``
(a hang, diagnosed live), ``ccld run`` of a plain DDP script that hangs, ``ccld diagnose``
of the boards it left, and the start-up hook in place. Exits 0 when every step did what
it should; prints each step and its time.

    python tools/wheel_check.py [--build-python .venv/bin/python] [--torch torch==2.13.0]
                                [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "jobs" / "scripts"
FAST = ["diagnoser.hang_min_s=3", "agent.stack_after_s=1", "agent.interval_s=0.5"]


class CheckFailed(RuntimeError):
    pass


def _step(name: str, cmd: list[str], timeout_s: float, **kwargs: object) -> str:
    """Run one step; its standard output, or CheckFailed with the end of its output."""
    start = time.monotonic()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        **kwargs,  # type: ignore[call-overload]
    )
    took = time.monotonic() - start
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        raise CheckFailed(f"{name}: exit {proc.returncode} after {took:.0f} s\n{out[-4000:]}")
    print(f"wheel-check: {name}: ok ({took:.0f} s)", flush=True)
    return proc.stdout


def _end(job: subprocess.Popen) -> None:
    """End a launcher's job as a scheduler does: SIGTERM first, which torchrun passes to
    its workers (each in a session of its own, out of reach of a signal to ours), then
    SIGKILL to what is left."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
    job.wait(10)


def _hung_job(venv: Path, work: Path, env: dict[str, str]) -> None:
    """``ccld run -- torchrun`` of a DDP script whose rank 1 hangs at step 4: the live
    verdict, then (the job killed as a scheduler would) the post-mortem's."""
    verdicts, boards = work / "verdicts.jsonl", work / "boards"
    sets = [*FAST, f"board.dir={boards}", "job=j", "board.cleanup=false", f"sinks.jsonl={verdicts}"]
    cmd = [str(venv / "bin" / "ccld"), "run", *sum((["--set", s] for s in sets), [])]
    cmd += ["--", str(venv / "bin" / "torchrun"), "--nproc-per-node", "2", "ddp_plain.py"]
    start = time.monotonic()
    with open(work / "job.log", "wb") as log:
        job = subprocess.Popen(
            cmd,
            cwd=work,
            env={**env, "FAULT": "hang@1:4", "STEPS": "30"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            while job.poll() is None and time.monotonic() - start < 120:
                if verdicts.exists() and '"hang"' in verdicts.read_text():
                    break
                time.sleep(0.5)
        finally:
            _end(job)
    live = (
        [json.loads(line) for line in verdicts.read_text().splitlines()]
        if verdicts.exists()
        else []
    )
    got = [(v["kind"], v["cause"], v["ranks"]) for v in live]
    if got != [("hang", "compute", [1])]:
        log_end = (work / "job.log").read_text(errors="replace")[-4000:]
        raise CheckFailed(
            f"ccld run: verdicts {got}, expected one compute hang of rank 1\n{log_end}"
        )
    print(f"wheel-check: ccld run: ok ({time.monotonic() - start:.0f} s)", flush=True)
    out = _step(
        "ccld diagnose",
        [str(venv / "bin" / "ccld"), "diagnose", str(boards / "j")],
        60,
        cwd=work,
        env=env,
    )
    if "HANG compute-bound: rank 1" not in out:
        raise CheckFailed(f"ccld diagnose: no compute hang of rank 1 in\n{out[-3000:]}")


def check(tmp: Path, build_python: str, torch_spec: str) -> None:
    dist, venv, work = tmp / "dist", tmp / "venv", tmp / "elsewhere"
    work.mkdir()
    _step(
        "pip wheel",
        [
            build_python,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            f"-Cbuild-dir={tmp / 'build'}",
        ],  # fmt: skip
        900,
    )
    (wheel,) = dist.glob("ccld_plugin-*.whl")
    _step("venv", [sys.executable, "-m", "venv", str(venv)], 120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _step(f"pip install {torch_spec}", [*pip, torch_spec], 600)
    torch_version = "import torch; print(torch.__version__)"
    before = _step("torch", [str(venv / "bin" / "python"), "-c", torch_version], 120)
    _step(f"pip install {wheel.name}", [*pip, str(wheel)], 600)
    after = _step("torch kept", [str(venv / "bin" / "python"), "-c", torch_version], 120)
    if before != after:
        raise CheckFailed(f"installing the wheel replaced torch: {before.strip()} -> {after}")
    # no source tree on the path: a folder of its own, and no PYTHONPATH
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    where = (
        "import ccld_plugin, ccld_plugin._native, _ccld_autoload, sys; "
        "print(ccld_plugin.__file__, _ccld_autoload.__file__); "
        "assert any(type(f).__name__ == '_AfterImport' for f in sys.meta_path), sys.meta_path"
    )
    out = _step(
        "installed files", [str(venv / "bin" / "python"), "-c", where], 60, cwd=work, env=env
    )
    if str(REPO) in out or "site-packages" not in out:
        raise CheckFailed(f"the package is not the installed one: {out}")
    demo = [str(venv / "bin" / "ccld"), "demo", "--framework", "torch", "--world", "2"]
    demo += ["--steps", "12", "--out", "demo", *sum((["--set", s] for s in FAST), [])]
    _step("ccld demo", demo, 300, cwd=work, env=env)
    for script in ("ddp_plain.py", "script_faults.py"):  # a user's script, copied
        shutil.copy(SCRIPTS / script, work / script)
    _hung_job(venv, work, env)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-python", default=str(REPO / ".venv" / "bin" / "python"))
    p.add_argument("--torch", default="torch==2.13.0", help="what pip installs first")
    p.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="work in DIR (a new folder) and keep it: the wheel, its venv (e.g. for "
        "benchmarks/startup_hook.py) and what the jobs left",
    )
    args = p.parse_args()
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ccld-wheel-")))
        else:
            tmp = args.keep
            tmp.mkdir(parents=True)
        try:
            check(tmp, args.build_python, args.torch)
        except (CheckFailed, subprocess.TimeoutExpired) as exc:
            print(f"wheel-check: FAILED: {exc}", file=sys.stderr)
            return 1
    print(f"wheel-check: passed in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
