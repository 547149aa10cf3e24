"""The native board: layout agreement, seqlock under concurrent writers, survival of a
killed writer, and clear errors for files that are not boards."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cbuild import compile_c
from paths import CSRC, NATIVE_TESTS

from ccld_plugin import _native
from ccld_plugin.board.reader import BoardError, BoardReader
from ccld_plugin.wire.codes import OP_CODES

STRUCTS = {
    "header": "ccld_header",
    "group": "ccld_group",
    "op": "ccld_op_record",
    "channel": "ccld_channel",
}


def _compile(tmp_path: Path, name: str, source: str) -> Path:
    exe = tmp_path / name
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    compile_c(exe, [src, CSRC / "board.c"])
    return exe


def test_exported_layout_agrees_with_the_c_header(tmp_path):
    layout = _native.layout()
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "board.h"', "int main(void) {"]
    for key, struct in STRUCTS.items():
        size, fields = layout[key]
        lines.append(f'printf("{key} :sizeof %zu\\n", sizeof({struct}));')
        for name, _, _ in fields:
            lines.append(f'printf("{key} {name} %zu\\n", offsetof({struct}, {name}));')
    lines.append("return 0; }")
    exe = _compile(tmp_path, "layout", "\n".join(lines))
    from_c = dict(
        line.rsplit(" ", 1)
        for line in subprocess.run(
            [str(exe)], capture_output=True, text=True, check=True
        ).stdout.splitlines()
    )
    for key in STRUCTS:
        size, fields = layout[key]
        assert int(from_c[f"{key} :sizeof"]) == size
        for name, offset, _ in fields:
            assert int(from_c[f"{key} {name}"]) == offset, (key, name)


def test_wire_codes_agree_with_the_native_enums():
    from ccld_plugin.wire import codes

    native = _native.layout()["codes"]
    assert native["op"] == codes.OP_CODES
    assert native["state"] == (
        codes.STATE_EMPTY,
        codes.STATE_IN_FLIGHT,
        codes.STATE_DONE,
        codes.STATE_ERROR,
    )
    assert native["flag"] == (
        codes.FLAG_ASYNC,
        codes.FLAG_P2P,
        codes.FLAG_SEND,
        codes.FLAG_CUDA,
        codes.FLAG_DEVICE,
    )
    assert native["time"] == tuple(codes.TIME_NAMES)
    assert native["source"] == (codes.SOURCE_NONE, codes.SOURCE_NCCL, codes.SOURCE_TCP)
    assert native["direction"] == (codes.DIRECTION_SEND, codes.DIRECTION_RECV)
    assert native["wait"] == tuple(codes.WAIT_CODES[w] for w in codes.WAIT_NAMES)
    assert native["channel_total"] == codes.CHANNEL_TOTAL


def test_values_written_natively_read_back_through_numpy(tmp_path):
    path = tmp_path / "rank3.board"
    board = _native.Board(str(path), 3, 8, "jobx", "hostx", 64, 8, 4, 64)
    slot = board.register_group(0xABCDEF, 2, [1, 3, 5], 1)
    board.set_step(17)
    i1 = board.enter(slot, OP_CODES["all_reduce"], 1, 4096)
    board.exit(i1, 2)
    i2 = board.enter_p2p(slot, OP_CODES["send"], 2 | 4, 128, 5, 9)
    with BoardReader(path) as r:
        h = r.header()
        assert (h.rank, h.world, h.job, h.host, h.step) == (3, 8, "jobx", "hostx", 17)
        assert h.pid == os.getpid() and not h.closed
        (g,) = r.groups()
        assert (g.group_id, g.role, g.ranks) == (0xABCDEF, "tp", (1, 3, 5))
        table = r.group_table()
        assert int(table[0]["entered_seq"]) == 1 and int(table[0]["completed_seq"]) == 1
        ops = r.ops()
        assert [int(o["op"]) for o in ops] == [OP_CODES["all_reduce"], OP_CODES["send"]]
        first, second = ops
        assert (int(first["seq"]), int(first["bytes"]), int(first["state"])) == (1, 4096, 2)
        assert int(first["step"]) == 17 and first["exit_ns"] >= first["enter_ns"] > 0
        assert (int(second["seq"]), int(second["peer"]), int(second["state"])) == (9, 5, 1)
        assert int(second["flags"]) == 6
    assert i2 == i1 + 1
    board.close(unlink=True)
    assert not path.exists()


def test_many_writer_threads_never_give_a_reader_a_torn_record(tmp_path):
    exe = _compile(tmp_path, "stress", (NATIVE_TESTS / "board_stress.c").read_text())
    out = subprocess.run(
        [str(exe), str(tmp_path / "s.board"), "4", "200000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    torn, checked = (int(kv.split("=")[1]) for kv in out.stdout.split()[:2])
    assert torn == 0 and checked > 100000


def _consistent(ops: np.ndarray) -> bool:
    return bool(
        np.all(ops["bytes"] == ops["seq"] * 3 + 1)
        and np.all(ops["peer"] == (ops["seq"] % 1000).astype(np.int32))
    )


def test_reader_in_another_process_while_writers_run_then_writer_killed(tmp_path):
    exe = _compile(tmp_path, "stress", (NATIVE_TESTS / "board_stress.c").read_text())
    path = tmp_path / "w.board"
    proc = subprocess.Popen([str(exe), str(path), "3", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        reads, start = 0, time.monotonic()
        with BoardReader(path) as reader:
            # At least 2 s and 20 reads (a loaded machine gives the reader little CPU).
            while (time.monotonic() - start < 2 or reads < 20) and time.monotonic() - start < 60:
                ops = reader.ops()
                assert len(ops) > 0 and _consistent(ops)
                reads += 1
        os.kill(proc.pid, signal.SIGKILL)  # mid-write, with high probability
        proc.wait(timeout=10)
        with BoardReader(path) as reader:
            ops = reader.ops()
            assert _consistent(ops) and len(ops) >= 16 - 3  # at most one open record/writer
            assert not reader.header().closed
        assert reads >= 20
    finally:
        if proc.poll() is None:
            proc.kill()


WRITER = """
import sys
from ccld_plugin import _native
b = _native.Board(sys.argv[1], 0, 1, "j", "h", 64, 4, 0, 16)
slot = b.register_group(7, 1, [0], 0)
for seq in range(1, 21):
    b.exit(b.enter(slot, 1, 0, seq * 10), 2)
b.enter(slot, 10, 0, 0)  # a barrier that never completes: the 'last op'
print("ready", flush=True)
import time
time.sleep(60)
"""


def test_sigkilled_writer_leaves_its_last_op_readable(tmp_path):
    path = tmp_path / "k.board"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    with BoardReader(path) as reader:
        ops = reader.ops()
        assert len(ops) == 21
        last = ops[-1]
        assert (int(last["op"]), int(last["state"]), int(last["seq"])) == (10, 1, 21)
        assert [int(o["bytes"]) for o in ops[:-1]] == [s * 10 for s in range(1, 21)]
        assert reader.header().pid == proc.pid


def test_truncated_foreign_and_missing_files_get_clear_errors(tmp_path):
    path = tmp_path / "t.board"
    _native.Board(str(path), 0, 1, "j", "h", 64, 4, 0, 16).close(unlink=False)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BoardError, match="truncated"):
        BoardReader(path)
    path.write_bytes(data[:100])
    with pytest.raises(BoardError, match="too small"):
        BoardReader(path)
    foreign = tmp_path / "f.board"
    foreign.write_bytes(b"\x7fELF" + bytes(len(data)))
    with pytest.raises(BoardError, match="not a ccld board"):
        BoardReader(foreign)
    with pytest.raises(BoardError, match="cannot be opened"):
        BoardReader(tmp_path / "missing.board")
