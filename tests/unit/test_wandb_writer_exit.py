"""The W&B writer process ends by itself once the training process is gone, even when
end-of-file never comes (a process the training process forked holds the pipe open)."""

from __future__ import annotations

import os
import time

from ccld_plugin.sinks.wandb.worker import QUIET_S, encode_message, read_messages


def test_messages_end_when_the_parent_is_gone_though_the_pipe_stays_open():
    r, w = os.pipe()
    try:
        os.write(w, encode_message({"op": "log", "n": 1}) + encode_message({"op": "log", "n": 2}))
        gone = os.getppid() + 1_000_000  # not our parent: as if ours had died
        t0 = time.monotonic()
        with os.fdopen(r, "rb", buffering=0) as fh:
            got = [m["n"] for m in read_messages(fh, parent=gone)]
        assert got == [1, 2]  # what was sent is read first, then the quiet pipe ends it
        assert time.monotonic() - t0 < QUIET_S + 2
    finally:
        os.close(w)


def test_messages_end_at_end_of_file_while_the_parent_lives():
    r, w = os.pipe()
    os.write(w, encode_message({"op": "log", "n": 1}))
    os.close(w)  # end-of-file after one message
    with os.fdopen(r, "rb", buffering=0) as fh:
        assert [m["n"] for m in read_messages(fh, parent=os.getppid())] == [1]
