"""Run real multi-process jobs for the tests: one process per rank on gloo."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ccld_plugin.harness.launch import LocalJob

SCRIPTS = Path(__file__).parent / "scripts"


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
        bad = {r: c for r, c in enumerate(self.codes) if c != 0}
        assert not bad, f"ranks exited badly {bad}:\n" + "\n".join(
            f"--- rank {r}\n{self.logs[r][-3000:]}" for r in bad
        )
        return self


def run_job(
    script: str,
    world: int,
    out: Path,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> JobResult:
    target = ["-m", script] if script.startswith("ccld_plugin.") else [str(SCRIPTS / script)]
    job = LocalJob(world=world, argv=[*target, *args], log_dir=out / "logs", env=env or {})
    job.start()
    finished = job.wait(timeout_s)
    codes = job.stop()
    logs = [(out / "logs" / f"rank{r}.log").read_text(errors="replace") for r in range(world)]
    assert finished, f"job {script} did not finish in {timeout_s}s:\n" + "\n".join(
        f"--- rank {r}\n{log[-2000:]}" for r, log in enumerate(logs)
    )
    return JobResult(codes, logs, out)
