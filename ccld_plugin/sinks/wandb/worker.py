"""The W&B writer: turns the sink's messages into wandb calls.

Two homes. When the training process already has a run (``wandb.run``: the user's own,
Megatron's W&B writer, DeepSpeed's W&B monitor), :class:`Applier` runs in-process on the
sink's thread and logs into it. Otherwise this file runs as its own process (started by
path, so it imports neither torch nor the plugin) and owns the sink's run: the training
process writes length-prefixed JSON messages to its stdin and it answers status lines on
stdout. wandb keeps the offline ``.wandb`` file in memory until the run finishes, so a
run that lives in a training process is lost when the job is killed (how every hung job
ends); this process sees end-of-file on stdin however the training process ends, and
finishes the run properly. It also watches the training process (its pid is the first
argument): a child the training process forked may hold the pipe open, and end-of-file
would then never come; once the training process is gone and the pipe is quiet, the
writer finishes the run all the same.

Before finishing, the writer attaches the job's timeline (``ccld_trace.json``, see
:class:`Timeline`) when the sink told it where the boards are.

Standard library and wandb only; wandb is imported when a run is opened, never at import.
"""

from __future__ import annotations

import base64
import json
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["Applier", "Timeline", "encode_message", "main", "read_messages"]

_LEN = struct.Struct("<I")
FINISH_TIMEOUT_S = 120.0  # an online finish that cannot reach the server gives up here
QUIET_S = 1.0  # how long the pipe is read before the training process is checked on
TIMELINE_FILE = "ccld_trace.json"
TIMELINE_TIMEOUT_S = 60.0  # for ``ccld trace`` in the writer process


def encode_message(msg: dict) -> bytes:
    data = json.dumps(msg, separators=(",", ":")).encode()
    return _LEN.pack(len(data)) + data


def read_messages(fh: IO[bytes], parent: int | None = None) -> Iterator[dict]:
    """Messages until end-of-file (the training process closed the pipe or died) or, with
    ``parent``, until that process is no longer this one's parent and the pipe is quiet."""
    while True:
        head = _read(fh, _LEN.size, parent)
        if len(head) < _LEN.size:
            return
        (n,) = _LEN.unpack(head)
        data = _read(fh, n, parent)
        if len(data) < n:
            return  # torn by the writer's death: nothing after it can be trusted
        yield json.loads(data)


def _read(fh: IO[bytes], n: int, parent: int | None) -> bytes:
    """Up to ``n`` bytes: fewer at end-of-file, or once ``parent`` is gone and nothing
    came for QUIET_S (read unbuffered, so that what select sees is all there is)."""
    if parent is None:
        return fh.read(n)
    fd, parts, got = fh.fileno(), [], 0
    while got < n:
        ready, _, _ = select.select([fd], [], [], QUIET_S)
        if not ready:
            if os.getppid() != parent:
                break
            continue
        chunk = os.read(fd, n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class Timeline:
    """The job's timeline, attached to the run as a file (``ccld_trace.json``, Trace Event
    JSON for Perfetto or chrome://tracing) when the run ends.

    Made by ``ccld trace`` over the job's board directory, in a process of its own: the
    sink does not read boards (the layout's one-way rule: the post-mortem reads boards and
    hands out files, the sink only attaches one), and this file imports nothing of the
    plugin. The verdicts marked on it are the ones the sink was given, so the timeline and
    the run's verdict table agree. It runs when the messages end, which for a hung job is
    when the job is killed: the boards are what the ranks left at their end."""

    def __init__(self) -> None:
        self.boards: str | None = None  # the job's board directory, from the sink
        self.python = sys.executable  # the training process's interpreter, from the sink
        self.verdicts: list[dict] = []

    def boards_left(self) -> bool:
        """Whether any board is still there: a job that ended normally with
        ``board.cleanup`` on has removed them (nothing to draw, and nothing wrong)."""
        try:
            return self.boards is not None and any(
                n.endswith(".board") for n in os.listdir(self.boards)
            )
        except OSError:
            return False

    def write(self, files_dir: str, timeout_s: float) -> str:
        """Write the timeline into ``files_dir``; its path. Raises when ``ccld trace``
        fails (its last line of output says why) or takes longer than ``timeout_s``."""
        assert self.boards is not None
        command = [self.python, "-m", "ccld_plugin.cli", "trace", self.boards]
        path = os.path.join(files_dir, TIMELINE_FILE)
        # Outside the run's files: an input of ``ccld trace`` only.
        fd, marks = tempfile.mkstemp(prefix="ccld-verdicts-", suffix=".jsonl")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(v) + "\n" for v in self.verdicts)
        try:
            done = subprocess.run(
                [*command, "-o", path, "--verdicts", marks],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        finally:
            os.unlink(marks)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            raise RuntimeError(f"ccld trace exited with code {done.returncode}: {lines[-1]}")
        return path


class Applier:
    """Applies messages to one run. ``attached``: the run is someone else's, so history
    is merged into their current step (``commit=False``) and never advances it; their own
    ``log(step=...)`` calls (Megatron's and DeepSpeed's writers pass explicit steps) would
    otherwise be dropped as out of order."""

    def __init__(self, wandb: Any, run: Any, attached: bool) -> None:
        self.wandb = wandb
        self.run = run
        self.attached = attached
        self.timeline = Timeline()

    def value(self, v: Any) -> Any:
        """A tagged plain value as the wandb object it describes."""
        if not isinstance(v, dict) or "_ccld" not in v:
            return v
        wb, kind = self.wandb, v["_ccld"]
        if kind == "table":
            return wb.Table(columns=v["columns"], data=v["data"], allow_mixed_types=True)
        if kind == "html":
            return wb.Html(v["html"], inject=False, data_is_not_path=True)
        if kind == "bar":
            table = wb.Table(columns=v["columns"], data=v["data"], allow_mixed_types=True)
            return wb.plot.bar(table, v["label"], v["value"], title=v.get("title", ""))
        if kind == "lines":
            return wb.plot.line_series(
                xs=v["xs"],
                ys=v["ys"],
                keys=v["keys"],
                title=v.get("title", ""),
                xname=v.get("xname", "x"),
            )
        raise ValueError(f"unknown panel kind {kind!r}")

    def apply(self, msg: dict) -> None:
        op, run = msg["op"], self.run
        if op == "define":
            run.define_metric(
                msg["name"], step_metric=msg.get("step_metric"), summary=msg.get("summary")
            )
        elif op == "log":
            data = {k: self.value(v) for k, v in msg["data"].items()}
            run.log(data, commit=False) if self.attached else run.log(data)
        elif op == "summary":
            for k, v in msg["data"].items():
                run.summary[k] = self.value(v)
        elif op == "alert":
            run.alert(
                title=msg["title"][:63],
                text=msg["text"],
                level=msg.get("level", "WARN"),
                wait_duration=msg.get("wait_s", 1),
            )
        elif op == "file":
            path = os.path.join(run.dir, msg["name"])
            with open(path, "wb") as fh:
                fh.write(base64.b64decode(msg["b64"]))
            run.save(path, base_path=run.dir, policy="end")
        elif op == "timeline":
            self.timeline.boards, self.timeline.python = msg["boards"], msg["python"]
        elif op == "verdict":
            self.timeline.verdicts.append(msg["record"])
        else:
            raise ValueError(f"unknown message {op!r}")

    def attach_timeline(self, timeout_s: float) -> bool:
        """Write the job's timeline and save it with the run; False when there is none to
        write (the sink gave no board directory, or no board is left in it)."""
        if not self.timeline.boards_left():
            return False
        path = self.timeline.write(self.run.dir, timeout_s)
        self.run.save(path, base_path=self.run.dir, policy="now")
        return True


def _status(out: IO[bytes], **fields: Any) -> None:
    try:
        out.write((json.dumps(fields) + "\n").encode())
        out.flush()
    except (OSError, ValueError):
        pass  # nobody is listening any more


def _open_run(kwargs: dict) -> tuple[Any, Any]:
    import wandb

    if kwargs.get("dir"):
        os.makedirs(kwargs["dir"], exist_ok=True)
    settings = wandb.Settings(
        console="off",
        silent=True,
        disable_git=True,
        save_code=False,
        x_disable_stats=True,
        x_save_requirements=False,
    )
    run = wandb.init(**kwargs, reinit="create_new", settings=settings)
    return wandb, run


def main() -> int:
    # Started by path: Python put this file's directory first on sys.path, and the sink's
    # own module there is named wandb.py. Drop it so that `import wandb` finds wandb.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        # Nothing here is urgent; the training ranks that share these cores are.
        os.nice(10)
    except OSError:
        pass
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    messages = read_messages(inp, parent=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    first = next(messages, None)
    if first is None or first.get("op") != "init":
        return 2
    try:
        wandb, run = _open_run(first["kwargs"])
    except BaseException as exc:  # noqa: BLE001 - reported to the training process
        _status(out, error=f"{type(exc).__name__}: {exc}")
        return 1
    _status(out, ready=True, dir=os.path.dirname(run.dir), id=run.id)
    print(
        f"[ccld] W&B run {run.id} ({run.settings.mode}) in {os.path.dirname(run.dir)}; "
        f"upload an offline run with: wandb sync {os.path.dirname(run.dir)}",
        file=sys.stderr,
        flush=True,
    )
    applier = Applier(wandb, run, attached=False)
    failed: set[str] = set()
    for msg in messages:
        if msg.get("op") == "finish":
            break
        try:
            applier.apply(msg)
        except Exception as exc:  # noqa: BLE001 - one bad panel must not end the run
            if msg.get("op") not in failed:
                failed.add(msg.get("op", "?"))
                _status(out, failed=msg.get("op"), error=f"{type(exc).__name__}: {exc}")
                traceback.print_exc()
    try:
        if applier.timeline.boards is not None and not applier.attach_timeline(TIMELINE_TIMEOUT_S):
            print("[ccld] no timeline in the W&B run: no boards left", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - the run is finished without it
        _status(out, failed="timeline", error=f"{type(exc).__name__}: {exc}")
        print(f"[ccld] no timeline in the W&B run: {exc}", file=sys.stderr, flush=True)
    # However finish goes (an online run with no network), this process must end.
    timer = threading.Timer(FINISH_TIMEOUT_S, os._exit, args=(3,))
    timer.daemon = True
    timer.start()
    run.finish()
    timer.cancel()
    _status(out, finished=True)
    return 0  # a normal exit, so that wandb removes its temporary directories


if __name__ == "__main__":
    raise SystemExit(main())
