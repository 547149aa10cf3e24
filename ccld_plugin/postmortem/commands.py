"""What ``ccld diagnose``, ``ccld trace`` and ``ccld replay`` print and write, and their
exit code: 0, or 1 when boards at the path could not be read or had corrupt records left
out (each said on stderr, in ``ccld inspect``'s words; the rest is diagnosed)."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from ccld_plugin.diagnose import Verdict
from ccld_plugin.postmortem.boards import JobBoards, PostmortemError, load_boards
from ccld_plugin.postmortem.diagnose_boards import (
    diagnose_boards,
    failed_beyond,
    job_config,
    saved_config,
)
from ccld_plugin.postmortem.inspect_boards import corrupt_warning
from ccld_plugin.postmortem.outputs import check_new
from ccld_plugin.postmortem.replay import replay
from ccld_plugin.postmortem.timeline import write_trace
from ccld_plugin.postmortem.verdict_files import (
    append_verdicts,
    check_verdicts_out,
    read_verdict_file,
)
from ccld_plugin.recording import RecordingError
from ccld_plugin.sinks import render_verdict

__all__ = ["diagnose", "replay_recording", "trace"]


def _header(boards: JobBoards, path: str, console: Console) -> None:
    console.print(
        f"[bold]ccld diagnose[/]: job {boards.job!r}, {len(boards.ranks)} of {boards.world} "
        f"boards at {path}"
    )
    _notes(boards, console)


def _notes(boards: JobBoards, console: Console) -> None:
    for note in boards.notes:
        console.print(f"[yellow]note: {note}[/]")


def _damage(boards: JobBoards) -> int:
    """Say on stderr which boards could not be read and which had corrupt records left
    out; 1 when any, else 0."""
    for why in boards.unreadable:
        print(f"ccld: error: {why}", file=sys.stderr)
    damaged = boards.damaged()
    for b in damaged:
        print(f"ccld: warning: {corrupt_warning(str(b.path), b.corrupt)}", file=sys.stderr)
    return 1 if boards.unreadable or damaged else 0


def _emit(verdicts: list[Verdict], jsonl: Path | None, force: bool, console: Console) -> None:
    for v in verdicts:
        console.print(render_verdict(v.to_dict()))
    if jsonl is not None:
        append_verdicts(jsonl, [v.to_dict() for v in verdicts], force)


def diagnose(
    path: Path | list[Path],
    config: Path | None,
    overrides: list[str],
    jsonl: Path | None,
    force: bool,
    console: Console,
) -> int:
    """Diagnose the boards at ``path``: one folder, or a list of them (a job's hosts)."""
    paths = path if isinstance(path, list) else [path]
    if jsonl is not None:
        check_verdicts_out(jsonl, force)
    boards = load_boards(*paths)
    # the job's config, from the first folder that holds it (the diagnoser rank's host)
    cfg = job_config(next((p for p in paths if saved_config(p)), paths[0]), config, overrides)
    _header(boards, ", ".join(str(p) for p in paths), console)
    verdicts = diagnose_boards(boards, cfg)
    _emit(verdicts, jsonl, force, console)
    if not verdicts:
        raised, beyond = failed_beyond(boards)
        if beyond:
            console.print(
                f"no verdict from these boards: collectives of rank(s) {raised} raised, in "
                f"ops with rank(s) {beyond}, which left no board here (removed at a clean "
                "exit, or kept on another host): read their logs, or their host's boards"
            )
        else:
            console.print("no verdict: no rank was hung, stuck, gone or mismatched at the end")
    return _damage(boards)


def replay_recording(
    path: Path,
    config: Path | None,
    overrides: list[str],
    jsonl: Path | None,
    force: bool,
    console: Console,
) -> int:
    if jsonl is not None:
        check_verdicts_out(jsonl, force)
    try:
        _, verdicts = replay(path, config, overrides)
    except RecordingError as exc:
        raise PostmortemError(str(exc)) from None
    _emit(verdicts, jsonl, force, console)
    if not verdicts:
        console.print("no verdict in the recorded rounds")
    return 0


def trace(
    path: Path,
    output: Path,
    verdicts_file: Path | None,
    config: Path | None,
    overrides: list[str],
    force: bool,
    console: Console,
) -> int:
    check_new(output, force)
    boards = load_boards(path)
    _notes(boards, console)
    left_out = None
    if verdicts_file is not None:
        verdicts, left_out = read_verdict_file(verdicts_file)
    else:
        cfg = job_config(path, config, overrides)
        verdicts = [v.to_dict() for v in diagnose_boards(boards, cfg)]
    n = write_trace(boards, verdicts, output, replace=force)
    console.print(
        f"wrote {output}: {n} events, {len(boards.ranks)} ranks, {len(verdicts)} verdict(s); "
        "open it in https://ui.perfetto.dev or chrome://tracing"
    )
    if left_out is not None:
        print(f"ccld: warning: {left_out}", file=sys.stderr)
    return max(_damage(boards), int(left_out is not None))
