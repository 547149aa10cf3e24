"""Files the plugin keeps beside the boards, for a post-mortem of a job that is gone: the
main-thread stack of a stuck rank (``rank<r>.stack``, the one part of a summary that is not
on the board), the uncaught exception a rank left on (``rank<r>.crash``: where it was
raised, then the exception) and the job's configuration (its thresholds, for the same
analysis)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ccld_plugin.files import replace_private

__all__ = [
    "JOB_CONFIG",
    "board_file",
    "read_crash",
    "read_stack",
    "remove_stack",
    "stack_path",
    "write_crash",
    "write_stack",
]

JOB_CONFIG = "ccld-config.yaml"  # in the job's board directory, written by the diagnoser rank


def board_file(job_dir: Path, rank: int) -> Path:
    """Rank ``rank``'s board in its job's board directory."""
    return job_dir / f"rank{rank}.board"


def stack_path(board: Path) -> Path:
    return board.with_suffix(".stack")


def write_stack(board: Path, frames: Sequence[str]) -> None:
    _write_frames(stack_path(board), frames)


def remove_stack(board: Path) -> None:
    stack_path(board).unlink(missing_ok=True)


def read_stack(board: Path) -> list[str]:
    """The frames a stuck rank last wrote, or [] (none written, or unreadable)."""
    return _read_frames(stack_path(board))


def write_crash(board: Path, record: Sequence[str]) -> None:
    _write_frames(board.with_suffix(".crash"), record)


def read_crash(board: Path) -> list[str]:
    """The uncaught exception the rank left on (see ``write_crash``), or []."""
    return _read_frames(board.with_suffix(".crash"))


def _write_frames(path: Path, frames: Sequence[str]) -> None:
    """Replace the file atomically: a reader sees the old frames or the new, never half."""
    replace_private(path, json.dumps(list(frames)).encode())


def _read_frames(path: Path) -> list[str]:
    try:
        return [str(f) for f in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        return []
