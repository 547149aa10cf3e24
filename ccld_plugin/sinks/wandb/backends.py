"""Where the W&B sink's messages go: into the process's own run, applied in this process
(:class:`AttachedRun`), or to a writer process that owns a run of its own
(:class:`WriterProcess`, see :mod:`ccld_plugin.sinks.wandb.worker`)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import IO, Any, Protocol

from ccld_plugin.errors import log, report_error
from ccld_plugin.sinks.wandb.worker import Applier, encode_message

__all__ = ["AttachedRun", "Backend", "WandbUnavailable", "WriterProcess"]

PIPE_SIZE = 1 << 20  # room for what the writer process has not read yet (it starts slowly)


class WandbUnavailable(RuntimeError):
    """W&B cannot be written to (not installed, broken, or its writer died)."""


class Backend(Protocol):
    failure: str | None

    def send(self, msgs: list[dict]) -> None: ...

    def close(self, wait_s: float) -> None: ...


class AttachedRun:
    """The process's own run: apply in this thread, and leave the run open at close."""

    def __init__(self, wandb: Any, run: Any) -> None:
        self.applier = Applier(wandb, run, attached=True)
        self.failure: str | None = None
        self._failed: set[str] = set()
        log.info("ccld: W&B panels go into the existing run %s", getattr(run, "id", "?"))

    def send(self, msgs: list[dict]) -> None:
        for m in msgs:
            try:
                self.applier.apply(m)
            except Exception as exc:  # noqa: BLE001 - one panel must not stop the others
                report_error(f"sinks.wandb.{m.get('op')}", exc)

    def close(self, wait_s: float) -> None:
        """The run stays open (it is the user's); the job's timeline is saved into it."""
        try:
            self.applier.attach_timeline(wait_s)
        except Exception as exc:  # noqa: BLE001 - the run goes on without it
            report_error("sinks.wandb.timeline", exc)


class WriterProcess:
    """A writer process that owns the run (see :mod:`ccld_plugin.sinks.wandb.worker`)."""

    def __init__(self, init_kwargs: dict, python: str) -> None:
        worker = Path(__file__).with_name("worker.py")
        # Its own session: the launcher's kill of the job's process group must not take
        # it down before it has finished the run. It ends by itself once this process is
        # gone (given its pid: worker.read_messages).
        self.proc = subprocess.Popen(
            [python, str(worker), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        # Both are pipes (PIPE above), so Popen has set them.
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin: IO[bytes] = self.proc.stdin
        self._stdout: IO[bytes] = self.proc.stdout
        try:
            fcntl.fcntl(self._stdin.fileno(), 1031, PIPE_SIZE)  # F_SETPIPE_SZ
        except OSError:
            pass  # the default 64 KiB pipe works too, only with less slack
        self.failure: str | None = None
        self.ready = threading.Event()
        self.run_dir: str | None = None
        self._status = threading.Thread(
            target=self._read_status, name="ccld-wandb-status", daemon=True
        )
        self._status.start()
        self.send([{"op": "init", "kwargs": init_kwargs}])

    def _read_status(self) -> None:
        for line in self._stdout:
            try:
                st = json.loads(line)
            except ValueError:
                continue
            if st.get("ready"):
                self.run_dir = st.get("dir")
                self.ready.set()
            elif st.get("failed"):  # one kind of panel failed; the run goes on
                report_error(f"sinks.wandb.{st['failed']}", WandbUnavailable(st.get("error")))
            elif st.get("error"):
                self.failure = f"the W&B writer could not open a run: {st['error']}"
                report_error("sinks.wandb", WandbUnavailable(self.failure))
        if not self.ready.is_set() and self.failure is None:
            code = self.proc.wait()
            self.failure = f"the W&B writer exited with code {code} before opening a run"
            report_error("sinks.wandb", WandbUnavailable(self.failure))

    def send(self, msgs: list[dict]) -> None:
        if self.failure:
            raise WandbUnavailable(self.failure)
        try:
            self._stdin.write(b"".join(encode_message(m) for m in msgs))
            self._stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            self.failure = self.failure or f"the W&B writer is gone ({exc})"
            raise WandbUnavailable(self.failure) from None

    def close(self, wait_s: float) -> None:
        try:
            self.send([{"op": "finish"}])
            self._stdin.close()
        except (WandbUnavailable, OSError):
            pass
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            log.info("ccld: the W&B writer is still finishing the run; it ends on its own")
