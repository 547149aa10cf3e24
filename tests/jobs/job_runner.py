"""Run real multi-process jobs for the tests: one process per rank on gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccld_harness.demo import DemoOptions, run_demo
from ccld_harness.faults import netns
from ccld_harness.launch import LocalJob
from ccld_plugin.board.reader import BoardReader, board_files

SCRIPTS = Path(__file__).parent / "scripts"

# Short thresholds for tests (the defaults stay for users and the demo): a hang after 3 s,
# stacks after 1 s in flight, an agent report every 0.5 s.
FAST = ("diagnoser.hang_min_s=3", "agent.stack_after_s=1", "agent.interval_s=0.5")
# ... and a rank silent for 4 s is unresponsive (plain torch jobs: short, GIL-free waits).
FAST_UNRESPONSIVE = (*FAST, "diagnoser.unresponsive_s=4")


@dataclass
class JobResult:
    codes: list[int | None]
    logs: list[str]
    out: Path

    def json_lines(self, rank: int, tag: str) -> list:
        """Lines ``<tag> <json>`` that a rank printed."""
        return [
            json.loads(line[len(tag) + 1 :])
            for line in self.logs[rank].splitlines()
            if line.startswith(tag + " ")
        ]

    def check(self) -> JobResult:
        bad = {
            r: c
            for r, c in enumerate(self.codes)
            if c != 0 and not _teardown_abort(c, self.logs[r])
        }
        assert not bad, f"ranks exited badly {bad}:\n" + "\n".join(
            f"--- rank {r}\n{self.logs[r][-3000:]}" for r in bad
        )
        return self


def _teardown_abort(code: int | None, log: str) -> bool:
    """gloo aborting a rank at interpreter exit, after it printed its result, with ccld
    on or off, and with the process group destroyed ("terminate called without an active
    exception", SIGABRT; two fresh-clone runs of this suite hit it with ccld off): torch's
    teardown, not the job's run."""
    lines = log.rstrip().splitlines()
    return (
        code == -signal.SIGABRT
        and lines[-1:] == ["terminate called without an active exception"]
        and any(line.startswith("result ") for line in lines)
    )


def run_job(
    script: str,
    world: int,
    out: Path,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> JobResult:
    target = (
        ["-m", script]
        if script.startswith(("ccld_plugin.", "ccld_harness."))
        else [str(SCRIPTS / script)]
    )
    job = LocalJob(world=world, argv=[*target, *args], log_dir=out / "logs", env=env or {})
    job.start()
    finished = job.wait(timeout_s)
    codes = job.stop()
    logs = [(out / "logs" / f"rank{r}.log").read_text(errors="replace") for r in range(world)]
    assert finished, f"job {script} did not finish in {timeout_s}s:\n" + "\n".join(
        f"--- rank {r}\n{log[-2000:]}" for r, log in enumerate(logs)
    )
    return JobResult(codes, logs, out)


def demo(
    out: Path,
    *faults: str,
    overrides: tuple[str, ...] = FAST,
    extra: tuple[str, ...] = (),
    **options: Any,
) -> tuple[int, dict]:
    """Run ``ccld demo`` with ``faults`` into ``out``; its exit code and summary.json.
    ``options`` are DemoOptions fields (framework, world, tp, pp, steps, timeout_s, ...)."""
    opts = DemoOptions(faults=list(faults), out=out, overrides=[*overrides, *extra], **options)
    out.parent.mkdir(parents=True, exist_ok=True)  # the demo creates --out, not its parents
    code = run_demo(opts)
    return code, json.loads((out / "summary.json").read_text())


def only(summary: dict, kind: str, cause: str | None = None) -> dict:
    """The one verdict of ``kind`` (and ``cause``) in a demo's summary."""
    found = [
        v
        for v in summary["verdicts"]
        if v["kind"] == kind and (cause is None or v["cause"] == cause)
    ]
    # a diagnosis that raised (contained, logged once) shows beside the verdicts
    assert len(found) == 1, (summary["verdicts"], summary["contained_errors"])
    return found[0]


def facts(evidence: list[dict]) -> dict[str, list[dict]]:
    """A verdict record's evidence items by fact, in order: tests assert on the data."""
    out: dict[str, list[dict]] = {}
    for e in evidence:
        out.setdefault(e["fact"], []).append(e)
    return out


def shown_links(evidence: list[dict]) -> list[frozenset[int]]:
    """The connections a verdict record's evidence shows slow, in its order: by the
    channels (``link_slow``) or by their messages (``p2p_transfer``; a pipeline connection
    may be judged by either first)."""
    return [
        frozenset((e["data"]["rank"], e["data"]["peer"]))
        if e["fact"] == "link_slow"
        else frozenset((e["data"]["a"], e["data"]["b"]))
        for e in evidence
        if e["fact"] in ("link_slow", "p2p_transfer")
    ]


# Tests of slowness keep the default hang floor: on a loaded 2-core host a first step can
# keep the other ranks waiting 3 s, which the short floor of the hang tests would flag.
NO_SHORT_HANGS = ("diagnoser.hang_min_s=10",)
# A cut link: until data queued toward the cut rank goes unacknowledged, its peers' kernels
# cannot tell it from a frozen process (idle links look the same), and at a 4 s
# unresponsive_s its stopped heartbeat is named first ("unresponsive", 1 suite run in 4);
# the demo ends the job before the link's evidence makes it a communication hang. These
# tests keep the default.
CUT_LINK = ("diagnoser.unresponsive_s=10",)


def leftover_networks() -> list[str]:
    """Namespaces and state files of networks this process owns (other runs may be going
    on at the same time: only ours must be gone)."""
    runs = []
    for f in netns.STATE_DIR.glob("*.json") if netns.STATE_DIR.is_dir() else []:
        try:
            if json.loads(f.read_text()).get("pid") == os.getpid():
                runs.append(f.stem)
        except (OSError, ValueError):
            continue
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    names = [ln.split()[0] for ln in out.stdout.splitlines()]
    return [f"state file {r}.json" for r in runs] + [
        n for n in names if any(n.startswith(f"{netns.PREFIX}{r}-") for r in runs)
    ]


def netns_demo(
    tmp_path: Path, tp: int, pp: int, steps: int, *faults: str, world: int = 4, **options: Any
) -> tuple[int, dict]:
    """A torch demo (4 ranks unless told) in a closed network, which must leave no
    namespace behind."""
    result = demo(
        tmp_path / "out",
        *faults,
        world=world,
        tp=tp,
        pp=pp,
        steps=steps,
        netns=True,
        # every round's input, to replay a failure (ccld replay)
        overrides=(*FAST_UNRESPONSIVE, f"diagnoser.record={tmp_path / 'rounds.rec'}"),
        timeout_s=150,
        **{"framework": "torch", **options},
    )
    assert leftover_networks() == [], "the run left its network behind"
    return result


def board_roles(folder: Path) -> dict[int, set[str]]:
    """The roles of the groups on each rank's board in ``folder``."""
    out = {}
    for f in board_files(folder):
        with BoardReader(f) as r:
            out[r.header().rank] = {g.role for g in r.groups()}
    return out


# A verdict after which the job will not go on by itself.
TERMINAL = {"hang", "deadlock", "mismatch", "unresponsive", "crash"}


def run_until_verdict(
    cmd: list[str],
    env: dict[str, str],
    verdicts: Path,
    log: Path,
    timeout_s: float,
    end_on: frozenset[str] | set[str] = TERMINAL,
    cwd: Path | None = None,
) -> tuple[list[dict], int | None]:
    """Run a launcher command (its own session: every process it starts ends with it) until
    it exits, or until ``verdicts`` holds a verdict of a kind in ``end_on`` (by default
    those after which the job will not recover); then SIGTERM, SIGKILL after 15 s. The
    verdicts, and the exit code (None where the job was ended)."""
    from ccld_plugin.sinks.jsonl import read_verdicts

    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
        )
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if any(v["kind"] in end_on for v in read_verdicts(verdicts)):
                    time.sleep(1)  # its last records
                    break
                time.sleep(0.3)
        finally:
            code = proc.poll()
            if code is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)
    return read_verdicts(verdicts), code
