"""``ccld run`` under srun, one task per rank: every task started as srun starts it, with
srun's variables and none of torch's (no RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); on
loopback, and on two "nodes" (a network namespace each, on a closed bridge) whose ranks
reach the store over the namespaces' addresses and keep their boards in a folder of their
own node. After the job is killed, ``ccld diagnose`` over both nodes' folders names the
culprit of the hang as the live diagnoser did."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from job_runner import FAST, SCRIPTS, TERMINAL, leftover_networks

from ccld_harness.faults import netns
from ccld_plugin.cli import main
from ccld_plugin.integrations.slurm import PORT_BASE
from ccld_plugin.sinks.jsonl import read_verdicts

TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _job_id_with_a_free_port() -> int:
    """A Slurm job id whose store port (the mapping's 15000 + id % 10000) is free here."""
    for _ in range(100):
        job = random.randrange(100_000, 1_000_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", PORT_BASE + job % 10000))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port for the job's store")


def _srun(
    tasks: list[subprocess.Popen],
    tmp: Path,
    nodes: int,
    per_node: int,
    nodelist: str,
    fault: str,
    prefix: Callable[[int], list[str]] = lambda node: [],
    extra_env: dict[str, str] | None = None,
) -> list[dict]:
    """Start, into ``tasks``, ``nodes * per_node`` tasks of ``ccld run -- python
    ddp_plain.py`` as srun would (task r on node r // per_node, under ``prefix(node)``),
    each node's boards in ``tmp / "node<k>"``; wait for a verdict after which the job
    cannot go on, and return the verdicts (the tasks still run)."""
    world, job = nodes * per_node, _job_id_with_a_free_port()
    base = {k: v for k, v in os.environ.items() if k not in TORCH_VARIABLES}
    for k in ("MASTER_ADDR", "MASTER_PORT", "CCLD_AUTOLOAD"):
        base.pop(k, None)
    base.update(FAULT=fault, STEPS="60", OMP_NUM_THREADS="1", **(extra_env or {}))
    for rank in range(world):
        node = rank // per_node
        sets = [*FAST, f"board.dir={tmp / f'node{node}'}", "job=j", "board.cleanup=false"]
        sets += [f"sinks.jsonl={tmp / 'verdicts.jsonl'}"]
        env = {
            **base,
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(node),
            "SLURM_NTASKS": str(world),
            "SLURM_STEP_NUM_TASKS": str(world),
            "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
            "SLURM_STEP_NODELIST": nodelist,
            "SLURM_JOB_NODELIST": nodelist,
            "SLURM_JOB_ID": str(job),
        }
        (tmp / f"node{node}").mkdir(exist_ok=True)
        cmd = [*prefix(node), sys.executable, "-m", "ccld_plugin.cli", "run"]
        cmd += [*sum((["--set", s] for s in sets), []), "--", sys.executable, "-u"]
        log = open(tmp / f"task{rank}.log", "wb")  # noqa: SIM115 - the task's
        tasks.append(
            subprocess.Popen(
                [*cmd, str(SCRIPTS / "ddp_plain.py")],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()
    deadline = time.monotonic() + 150
    verdicts: list[dict] = []
    while time.monotonic() < deadline and any(t.poll() is None for t in tasks):
        verdicts = read_verdicts(tmp / "verdicts.jsonl")
        if any(v["kind"] in TERMINAL for v in verdicts):
            break
        time.sleep(0.3)
    return verdicts


def _kill(tasks: list[subprocess.Popen]) -> None:
    """As a scheduler ends a hung job: SIGKILL, no exit path."""
    for t in tasks:
        if t.poll() is None:
            os.killpg(t.pid, signal.SIGKILL)
        t.wait(10)


def _logs(tmp: Path) -> str:
    return "\n".join(
        f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}" for f in sorted(tmp.glob("task*"))
    )


def test_srun_tasks_on_loopback_hang(tmp_path):
    tasks: list[subprocess.Popen] = []
    try:
        verdicts = _srun(tasks, tmp_path, 1, 2, "localhost", "hang@1:5")
    finally:
        _kill(tasks)
    assert [(v["kind"], v["cause"], v["ranks"]) for v in verdicts] == [("hang", "compute", [1])], (
        verdicts,
        _logs(tmp_path),
    )
    assert (verdicts[0]["group"]["role"], verdicts[0]["group"]["ranks"]) == ("dp", [0, 1])


available, why = netns.available()


@pytest.mark.skipif(not available, reason=why)
def test_srun_tasks_on_two_nodes_hang_diagnosed_live_and_from_both_nodes_boards(tmp_path):
    tasks: list[subprocess.Popen] = []
    with netns.ClosedNetwork(2) as net:
        nodelist = f"{net.address(0)},{net.address(1)}"
        try:
            verdicts = _srun(
                tasks,
                tmp_path,
                2,
                2,
                nodelist,
                "hang@3:5",
                prefix=net.exec_prefix,
                extra_env={"GLOO_SOCKET_IFNAME": netns.RANK_IFNAME},
            )
            # a scheduler ends a hung job long after the hang began; killed the moment the
            # live verdict came, the boards' last heartbeat can be a tick short of the
            # hang threshold, and the post-mortem rightly finds no hang yet
            time.sleep(4 * 0.5)  # four agent ticks (FAST: agent.interval_s=0.5)
        finally:
            _kill(tasks)
    assert leftover_networks() == []
    assert [(v["kind"], v["cause"], v["ranks"]) for v in verdicts] == [("hang", "compute", [3])], (
        verdicts,
        _logs(tmp_path),
    )
    live = verdicts[0]
    assert (live["group"]["role"], live["group"]["ranks"]) == ("dp", [0, 1, 2, 3])
    # each node kept its own ranks' boards
    assert sorted(p.name for p in (tmp_path / "node0" / "j").glob("*.board")) == [
        "rank0.board",
        "rank1.board",
    ]
    assert sorted(p.name for p in (tmp_path / "node1" / "j").glob("*.board")) == [
        "rank2.board",
        "rank3.board",
    ]
    out = tmp_path / "postmortem.jsonl"
    folders = [str(tmp_path / "node0" / "j"), str(tmp_path / "node1" / "j")]
    assert main(["diagnose", *folders, "--jsonl", str(out)]) == 0
    (v,) = read_verdicts(out)
    assert (v["kind"], v["cause"], v["ranks"]) == ("hang", "compute", [3])
    assert (v["group"]["role"], v["group"]["ranks"]) == ("dp", [0, 1, 2, 3])
