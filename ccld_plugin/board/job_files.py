"""Files the plugin keeps beside the boards, for a post-mortem of a job that is gone: the
main-thread stack of a stuck rank (``rank<r>.stack``, the one part of a summary that is not
on the board) and the job's configuration (its thresholds, for the same analysis)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["JOB_CONFIG", "board_file", "read_stack", "remove_stack", "stack_path", "write_stack"]

JOB_CONFIG = "ccld-config.yaml"  # in the job's board directory, written by the diagnoser rank


def board_file(job_dir: Path, rank: int) -> Path:
    """Rank ``rank``'s board in its job's board directory."""
    return job_dir / f"rank{rank}.board"


def stack_path(board: Path) -> Path:
    return board.with_suffix(".stack")


def write_stack(board: Path, frames: Sequence[str]) -> None:
    """Replace the sidecar atomically: a reader sees the old stack or the new, never half."""
    path = stack_path(board)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(list(frames)))
    os.replace(tmp, path)


def remove_stack(board: Path) -> None:
    stack_path(board).unlink(missing_ok=True)


def read_stack(board: Path) -> list[str]:
    """The frames a stuck rank last wrote, or [] (none written, or unreadable)."""
    try:
        return [str(f) for f in json.loads(stack_path(board).read_text())]
    except (OSError, ValueError, TypeError):
        return []
