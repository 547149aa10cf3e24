"""What ``ccld diagnose`` and ``ccld trace`` print and write."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ccld_plugin.diagnose import Verdict
from ccld_plugin.postmortem.boards import JobBoards, PostmortemError, load_boards
from ccld_plugin.postmortem.diagnose_boards import diagnose_boards, failed_beyond, job_config
from ccld_plugin.postmortem.replay import replay
from ccld_plugin.postmortem.timeline import write_trace
from ccld_plugin.sinks import JsonlSink, render_verdict
from ccld_plugin.sinks.jsonl import read_verdicts

__all__ = ["diagnose", "replay_recording", "trace"]


def _header(boards: JobBoards, path: Path, console: Console) -> None:
    console.print(
        f"[bold]ccld diagnose[/]: job {boards.job!r}, {len(boards.ranks)} of {boards.world} "
        f"boards at {path}"
    )
    for note in boards.notes:
        console.print(f"[yellow]note: {note}[/]")


def _emit(verdicts: list[Verdict], jsonl: Path | None, console: Console) -> None:
    sink = JsonlSink(jsonl) if jsonl else None
    for v in verdicts:
        console.print(render_verdict(v.to_dict()))
        if sink:
            sink.emit(v)
    if sink:
        sink.close()


def diagnose(
    path: Path, config: Path | None, overrides: list[str], jsonl: Path | None, console: Console
) -> int:
    cfg = job_config(path, config, overrides)
    boards = load_boards(path)
    _header(boards, path, console)
    verdicts = diagnose_boards(boards, cfg)
    _emit(verdicts, jsonl, console)
    if verdicts:
        return 0
    raised, beyond = failed_beyond(boards)
    if beyond:
        console.print(
            f"no verdict from these boards: collectives of rank(s) {raised} raised, in ops "
            f"with rank(s) {beyond}, which left no board here (removed at a clean exit, or "
            "kept on another host): read their logs, or their host's boards"
        )
    else:
        console.print("no verdict: no rank was hung, stuck, gone or mismatched at the end")
    return 0


def replay_recording(
    path: Path, config: Path | None, overrides: list[str], jsonl: Path | None, console: Console
) -> int:
    try:
        _, verdicts = replay(path, config, overrides)
    except (OSError, ValueError) as exc:
        raise PostmortemError(f"{path}: {exc}") from None
    _emit(verdicts, jsonl, console)
    if not verdicts:
        console.print("no verdict in the recorded rounds")
    return 0


def trace(
    path: Path,
    output: Path,
    verdicts_file: Path | None,
    config: Path | None,
    overrides: list[str],
    console: Console,
) -> int:
    boards = load_boards(path)
    for note in boards.notes:
        console.print(f"[yellow]note: {note}[/]")
    if verdicts_file is not None:
        verdicts = read_verdicts(verdicts_file)
    else:
        cfg = job_config(path, config, overrides)
        verdicts = [v.to_dict() for v in diagnose_boards(boards, cfg)]
    n = write_trace(boards, verdicts, output)
    console.print(
        f"wrote {output}: {n} events, {len(boards.ranks)} ranks, {len(verdicts)} verdict(s); "
        "open it in https://ui.perfetto.dev or chrome://tracing"
    )
    return 0
