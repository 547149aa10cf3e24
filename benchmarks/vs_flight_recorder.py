"""The same faults, diagnosed by PyTorch's Flight Recorder and by ccld, side by side.

Each fault runs once in a real 4-rank gloo job on this machine (``benchmarks/fr_rank.py``)
with both on: Flight Recorder records every collective (``TORCH_FR_BUFFER_SIZE=2000``)
and every rank dumps its record once a collective times out (``--timeout-s``, the job's
process-group timeout; NCCL's watchdog dumps the same way with
``TORCH_NCCL_DUMP_ON_TIMEOUT``), then its analyzer
(``python -m torch.distributed.flight_recorder.fr_trace``) reads the dumps; the plugin
writes its live verdicts (JSONL sink) and its boards, and ``ccld diagnose`` reads the
boards twice: when the first collective times out (the moment Flight Recorder dumps) and
once the job is over (each rank that timed out ends itself, as a job does when its
collective raises, and the rest are killed). Faults: a compute hang, a collective
mismatch, a pipeline deadlock (two PP ranks that both receive first), a killed rank.

Prints one table (and writes it as Markdown to OUT/table.md): what each named, and
seconds from the fault's onset to each answer.

    python benchmarks/vs_flight_recorder.py [--timeout-s 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ccld_harness.launch import LocalJob
from ccld_plugin.sinks.jsonl import read_verdicts

RANK_SCRIPT = Path(__file__).with_name("fr_rank.py")
WORLD = 4
FAULTS = [  # (name, job, fault spec for the demo's injector)
    ("compute hang", "workload", "compute-hang@2:step=4"),
    ("collective mismatch", "workload", "mismatch@3:step=4"),
    ("PP deadlock", "pp-deadlock", ""),
    ("killed rank", "workload", "kill@2:step=4"),
]
TERMINAL = {"hang", "deadlock", "mismatch", "unresponsive"}
DUMP_WAIT_S = 30.0  # after the trigger, for every living rank's dump (gloo's take seconds)
ANALYZER_TIMEOUT_S = 120


@dataclass
class Answer:
    named: str = "-"
    after_s: float | None = None  # seconds after the fault's onset
    note: str = ""
    output: list[str] = field(default_factory=list)


@dataclass
class Result:
    fault: str
    fr: Answer
    ccld_live: Answer
    diagnose_at_timeout: Answer  # run when the first collective timed out
    diagnose_after: Answer  # run once the job is over (every rank ended)


def _verdict_text(v: dict) -> str:
    g = v.get("group") or {}
    where = f" in {g.get('role')}{g.get('ranks')}" if g else ""
    op = f", {v['op']}" if v.get("op") else ""
    return f"{v['kind']} ({v['cause']}): ranks {v['ranks']}{where}{op}"


def _job(out: Path, job: str, fault: str, timeout_s: float) -> LocalJob:
    overrides = [
        f"board.dir={out}",
        "job=boards",
        "board.cleanup=false",
        f"sinks.jsonl={out / 'verdicts.jsonl'}",
        "sinks.console=false",
    ]
    args = ["--steps", "40", "--timeout-s", str(timeout_s)]
    # the workload's fault comes from CCLD_FAULTS; the deadlock job takes its step
    args = [*(["--tp", "1", "--pp", "1"] if job == "workload" else ["--step", "4"]), *args]
    env = {
        "CCLD_FAULT_LOG": str(out / "faults.jsonl"),
        "CCLD_FR_TRIGGER": str(out / "fr-dump-now"),
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": str(out / "fr" / "rank_"),
        "TORCHDYNAMO_DISABLE": "1",
    }
    if fault:
        env["CCLD_FAULTS"] = fault
    (out / "fr").mkdir(parents=True, exist_ok=True)
    return LocalJob(
        world=WORLD,
        argv=[str(RANK_SCRIPT), job, *args, *sum((["--ccld-set", o] for o in overrides), [])],
        log_dir=out / "logs",
        env=env,
        agent_store=True,  # the store outlives a killed rank, as under torchrun
    )


def _onset(out: Path) -> float | None:
    path = out / "faults.jsonl"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    return json.loads(lines[0])["wall_time"] if lines else None


def _dumps(out: Path) -> list[Path]:
    return sorted(p for p in (out / "fr").glob("rank_*") if p.suffix != ".tmp")


def _fr_dumps_hold(dumps: list[Path]) -> str:
    """What the raw dumps record, read directly (not the analyzer): each rank's last
    collective per group, and the state it was left in."""
    parts = []
    for path in dumps:
        doc = pickle.loads(path.read_bytes())
        last: dict[str, dict] = {}
        for e in doc.get("entries", []):
            last[e["process_group"][0]] = e
        shown = ", ".join(
            f"pg {pg} {e['profiling_name']} #{e['collective_seq_id']} {e['state']}"
            for pg, e in sorted(last.items())
        )
        parts.append(f"rank {path.name.removeprefix('rank_')}: {shown or 'no entry'}")
    config = pickle.loads(dumps[0].read_bytes()).get("pg_config")
    return "; ".join(parts) + f"; pg_config {config}"


def _fr_analyzer(out: Path, onset: float) -> Answer:
    dumps = _dumps(out)
    if not dumps:
        return Answer("nothing: no rank dumped", note="no dump")
    last_dump = max(p.stat().st_mtime for p in dumps)
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(out / "fr")]
    cmd += ["-p", "rank_"]
    if len(dumps) < WORLD:
        cmd.append("--allow-incomplete-ranks")
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=ANALYZER_TIMEOUT_S)
    took = time.time() - t0
    text = (done.stdout + done.stderr).strip().splitlines()
    (out / "fr_trace.txt").write_text("\n".join([" ".join(cmd), *text]) + "\n")
    ranks = sorted(int(p.name.removeprefix("rank_")) for p in dumps)
    note = f"dumps from ranks {ranks}; they hold: {_fr_dumps_hold(dumps)}"
    useful = [ln for ln in text if ln.strip() and "tabulate" not in ln]
    if done.returncode != 0:
        named = f"analyzer failed (exit {done.returncode}): {useful[-1] if useful else '?'}"
    else:
        named = " / ".join(useful[:3]) or "no finding printed"
    return Answer(named, round(last_dump + took - onset, 1), note, useful)


class Diagnose:
    """``ccld diagnose`` over the job's boards, as a user runs it, started at once."""

    def __init__(self, out: Path, name: str) -> None:
        self.out, self.name = out, name
        self.started = time.time()
        self.jsonl = out / f"diagnose-{name}.jsonl"
        cmd = [sys.executable, "-m", "ccld_plugin.cli", "diagnose", str(out / "boards")]
        self.proc = subprocess.Popen(
            [*cmd, "--jsonl", str(self.jsonl)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def answer(self, onset: float) -> Answer:
        text, _ = self.proc.communicate(timeout=120)
        finished = time.time()
        (self.out / f"diagnose-{self.name}.txt").write_text(text)
        verdicts = [v for v in read_verdicts(self.jsonl) if v["kind"] in TERMINAL]
        named = "; ".join(_verdict_text(v) for v in verdicts) or "no verdict"
        return Answer(named, round(finished - onset, 1))


def run_fault(root: Path, name: str, job_kind: str, fault: str, timeout_s: float) -> Result:
    out = root / name.replace(" ", "-")
    job = _job(out, job_kind, fault, timeout_s)
    live = Answer()
    deadline = time.time() + 60 + 2 * timeout_s
    onset = None
    job.start()
    try:
        trigger_seen = None
        at_timeout: Diagnose | None = None
        while time.time() < deadline:
            time.sleep(0.2)
            onset = onset or _onset(out)
            if onset and live.after_s is None:
                hits = [v for v in read_verdicts(out / "verdicts.jsonl") if v["kind"] in TERMINAL]
                if hits:
                    live.after_s = round(time.time() - onset, 1)
            if trigger_seen is None and (out / "fr-dump-now").exists():
                trigger_seen = time.time()
                # When Flight Recorder dumps, ccld diagnose looks too: the same moment.
                at_timeout = Diagnose(out, "at-timeout")
            alive = sum(c is None for c in job.poll())
            if trigger_seen and (
                len(_dumps(out)) >= WORLD or time.time() - trigger_seen > DUMP_WAIT_S
            ):
                break
            if not alive:
                break
        if at_timeout is not None:  # the job is ended once it has looked, not before
            first = at_timeout.answer(onset or trigger_seen or 0.0)
    finally:
        job.stop()
    if onset is None:
        none = Answer("fault never started")
        return Result(name, none, none, none, none)
    after = Diagnose(out, "after")  # at once, beside the Flight Recorder analyzer
    fr = _fr_analyzer(out, onset)
    if trigger_seen is None:
        fr.note = f"no collective timed out within {deadline - onset:.0f} s"
    # Every verdict the live diagnoser wrote; the time is the first one's.
    written = [v for v in read_verdicts(out / "verdicts.jsonl") if v["kind"] in TERMINAL]
    live.named = "; ".join(_verdict_text(v) for v in written) or "no verdict while the job ran"
    if at_timeout is None:
        first = Answer("no collective timed out")
    return Result(name, fr, live, first, after.answer(onset))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout-s", type=float, default=20.0, help="the job's collective timeout")
    p.add_argument("--out", type=Path, help="keep each run's files here (default: a temp dir)")
    p.add_argument("--only", help="run only the fault of this name")
    args = p.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="ccld-vs-fr-"))
    results = [
        run_fault(root, name, kind, fault, args.timeout_s)
        for name, kind, fault in FAULTS
        if args.only in (None, name)
    ]
    table = Table(
        title=f"Flight Recorder vs ccld, {WORLD} ranks, gloo, timeout {args.timeout_s:g} s"
    )
    columns = (
        "fault",
        "FR analyzer named",
        "FR s",
        "ccld live named",
        "live s",
        "ccld diagnose at the first timeout",
        "s",
        "ccld diagnose after the job",
        "s",
    )
    for col in columns:
        table.add_column(col)
    rows = [
        (
            r.fault,
            f"{r.fr.named} ({r.fr.note})",
            str(r.fr.after_s),
            r.ccld_live.named,
            str(r.ccld_live.after_s),
            r.diagnose_at_timeout.named,
            str(r.diagnose_at_timeout.after_s),
            r.diagnose_after.named,
            str(r.diagnose_after.after_s),
        )
        for r in results
    ]
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)
    md = [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}"]
    md += [f"| {' | '.join(c.replace('|', '/') for c in row)} |" for row in rows]
    (root / "table.md").write_text("\n".join(md) + "\n")
    (root / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(f"runs in {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
