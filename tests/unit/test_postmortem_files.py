"""The files the post-mortem commands (inspect, diagnose, trace, replay) read and write,
when they are not what they should be: a FIFO, a device, a socket or a folder is one line
and never blocks; a value no writer gives is a corrupt record or header; an output never
replaces a file unasked nor creates a folder; a bad verdicts file names its line. Real
files, FIFOs and sockets; boards written by the native writer."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
from builders import S, group, rank_summary

from ccld_plugin import _native
from ccld_plugin.board.job_files import JOB_CONFIG
from ccld_plugin.board.reader import GROUP_DTYPE, HEADER_DTYPE, OP_DTYPE
from ccld_plugin.cli import main
from ccld_plugin.config import load_config, to_yaml
from ccld_plugin.postmortem.boards import load_boards
from ccld_plugin.postmortem.diagnose_boards import job_view
from ccld_plugin.recording import RecordedRound, RoundRecorder
from ccld_plugin.topology import group_id_of, role_index
from ccld_plugin.wire.codes import OP_CODES
from ccld_plugin.wire.summary import GroupProgress, InFlightOp, encode_summary

# Every test here would block on the code these tests were written against (a FIFO opened
# for reading waits for a writer): a hang fails the test instead of stalling the tier.
pytestmark = pytest.mark.timeout(60)

WORLD = 2
DP = group("dp", range(WORLD))


def _write_job(folder: Path) -> Path:
    """Boards as a 2-rank job leaves them: three all-reduces done on each rank, then rank 0
    in a fourth that rank 1 never entered; closed, as at a clean exit."""
    folder.mkdir(exist_ok=True)
    for r in range(WORLD):
        b = _native.Board(
            str(folder / f"rank{r}.board"), r, WORLD, "j", socket.gethostname(), 16, 4, 4, 16
        )
        g = b.register_group(group_id_of(DP.ranks), role_index("dp"), list(DP.ranks), r)
        b.set_step(3)
        for _ in range(3):
            b.exit(b.enter(g, OP_CODES["all_reduce"], 0, 64), 2)
        if r == 0:
            b.enter(g, OP_CODES["all_reduce"], 0, 64)
        b.heartbeat()
        b.close(unlink=False)
    return folder


@pytest.fixture
def job(tmp_path: Path) -> Path:
    return _write_job(tmp_path / "j")


def _recording(path: Path) -> Path:
    """Recorded rounds in which rank 1 of a DP pair stops in compute (a hang verdict)."""
    cfg = load_config(None, ["diagnoser.hang_min_s=3"], writing=False)
    rec = RoundRecorder(path, to_yaml(cfg))
    for t in range(89, 100):
        stuck = [InFlightOp(0, OP_CODES["all_reduce"], 0, -1, 8, 64, 88 * S)]
        values = {
            0: encode_summary(
                rank_summary(
                    0,
                    t * S,
                    last_progress_ns=88 * S,
                    groups=[GroupProgress(0, 8, 7, 0, 0, 0, 0)],
                    in_flight=stuck,
                )
            ),
            1: encode_summary(
                rank_summary(
                    1, t * S, last_progress_ns=88 * S, groups=[GroupProgress(0, 7, 7, 0, 0, 0, 0)]
                )
            ),
        }
        tables = {0: [DP], 1: [DP]}
        rec.write(
            RecordedRound(now_ns=t * S, job_start_ns=0, world=2, values=values, tables=tables)
        )
    rec.close()
    return path


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    return _recording(tmp_path / "rounds.rec")


@pytest.fixture
def sock_at(tmp_path: Path):
    """Binds a Unix socket at a path; closed at the end."""
    opened: list[socket.socket] = []

    def bind(path: Path) -> Path:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        opened.append(s)
        return path

    yield bind
    for s in opened:
        s.close()


def _make(kind: str, path: Path, sock_at) -> Path:
    """A file of ``kind`` at ``path``: what a regular file is expected to be and is not."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "full":
        path.symlink_to("/dev/full")
    elif kind == "null":
        path.symlink_to("/dev/null")
    elif kind == "socket":
        sock_at(path)
    elif kind == "folder":
        path.mkdir()
    return path


KIND_WORDS = {
    "fifo": "a FIFO (named pipe)",
    "device": "a character device",
    "full": "a character device",
    "null": "a character device",
    "socket": "a socket",
    "folder": "a folder",
}
KINDS = list(KIND_WORDS)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _command(name: str, path: Path, tmp_path: Path) -> list[str]:
    return {
        "inspect": ["inspect", str(path), "--json"],
        "diagnose": ["diagnose", str(path)],
        "trace": ["trace", str(path), "-o", str(tmp_path / "out.json")],
    }[name]


# ------------------------------------------------------------------ inputs: what they are


@pytest.mark.parametrize("kind", KINDS[:-1])  # a folder given as the path is a folder of boards
@pytest.mark.parametrize("command", ["inspect", "diagnose", "trace"])
def test_a_board_that_is_no_regular_file_is_one_line(tmp_path, capsys, sock_at, kind, command):
    board = _make(kind, tmp_path / "rank0.board", sock_at)
    code, _, err = _run(capsys, *_command(command, board, tmp_path))
    assert code == 2
    assert _one_line(err) == f"ccld: error: {board}: {KIND_WORDS[kind]}, not a board file"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["inspect", "diagnose", "trace"])
def test_in_a_folder_such_a_board_is_skipped_with_a_line(
    job, tmp_path, capsys, sock_at, kind, command
):
    bad = job / "rank0.board"
    bad.unlink()
    _make(kind, bad, sock_at)
    code, out, err = _run(capsys, *_command(command, job, tmp_path))
    assert code == 1  # as inspect says of a folder with an unreadable board
    assert _one_line(err) == f"ccld: error: {bad}: {KIND_WORDS[kind]}, not a board file"
    if command == "inspect":
        assert [s["rank"] for s in json.loads(out)] == [1]  # the other board is read
    elif command == "diagnose":
        assert "1 of 2 boards" in out
    else:
        assert (tmp_path / "out.json").is_file() and "1 ranks" in out


@pytest.mark.parametrize("kind", KINDS)
def test_verdicts_that_are_no_regular_file_are_one_line(job, tmp_path, capsys, sock_at, kind):
    verdicts = _make(kind, tmp_path / "v.jsonl", sock_at)
    code, _, err = _run(capsys, *_command("trace", job, tmp_path), "--verdicts", str(verdicts))
    assert code == 2
    line = _one_line(err)
    assert line == f"ccld: error: {verdicts}: {KIND_WORDS[kind]}, not a verdicts file (JSON lines)"
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_recording_that_is_no_regular_file_is_one_line(tmp_path, capsys, sock_at, kind):
    rec = _make(kind, tmp_path / "rounds.rec", sock_at)
    code, _, err = _run(capsys, "replay", str(rec))
    assert code == 2
    line = _one_line(err)
    assert (
        line == f"ccld: error: {rec}: {KIND_WORDS[kind]}, not a round recording (diagnoser.record)"
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["diagnose", "trace"])
def test_a_job_config_that_is_no_regular_file_is_one_line(
    job, tmp_path, capsys, sock_at, kind, command
):
    saved = _make(kind, job / JOB_CONFIG, sock_at)
    code, _, err = _run(capsys, *_command(command, job, tmp_path))
    assert code == 2
    assert _one_line(err) == (
        f"ccld: error: {saved}: {KIND_WORDS[kind]}, not a regular file; the job's config is "
        "read from there: remove it, or pass --config FILE"
    )


def test_a_fifo_beside_a_board_is_left_out_with_a_line(job, tmp_path, capsys):
    os.mkfifo(job / "rank1.stack")  # where a stuck rank's stack is read from
    code, out, err = _run(capsys, "diagnose", str(job))
    assert code == 1 and "2 of 2 boards" in out
    expected = f"ccld: error: {job / 'rank1.stack'}: a FIFO (named pipe), not a regular file"
    assert _one_line(err) == expected + "; left out"


# ------------------------------------------------------------------ values no writer gives


def _patch(board: Path, dtype: np.dtype, field: str, value: int, table: str | None = None):
    """Write ``value`` into ``field`` of the header (``table`` None) or of the first record
    of a table (its offset's header field), as a corruption would."""
    data = bytearray(board.read_bytes())
    base = 0
    if table is not None:
        base = int(np.frombuffer(data, HEADER_DTYPE, 1)[0][table])
    at = base + dtype.fields[field][1]
    ftype = dtype.fields[field][0]
    data[at : at + ftype.itemsize] = np.array([value], dtype=ftype).tobytes()
    board.write_bytes(bytes(data))


I64, U64 = 2**63 - 1, 2**64 - 1
HEADER_VALUES = [
    ("clock_offset_ns", -I64),
    ("clock_offset_ns", I64),
    ("heartbeat_ns", I64),
    ("step_start_ns", I64),
    ("start_mono_ns", I64),
    ("start_wall_ns", -I64),
    ("step", I64),
    ("ops_written", U64),
    ("errors", U64),
]
RECORD_VALUES = [
    (GROUP_DTYPE, "groups_off", "entered_seq", U64),
    (GROUP_DTYPE, "groups_off", "completed_seq", 2**63),
    (GROUP_DTYPE, "groups_off", "last_exit_ns", I64),
    (OP_DTYPE, "ring_off", "seq", 2**63),
    (OP_DTYPE, "ring_off", "enter_ns", I64),
    (OP_DTYPE, "ring_off", "exit_ns", I64),
    (OP_DTYPE, "ring_off", "bytes", 2**47),
]


@pytest.mark.filterwarnings("error")  # a numpy overflow warning is a failure, not garbage
@pytest.mark.parametrize("field, value", HEADER_VALUES)
@pytest.mark.parametrize("command", ["inspect", "diagnose", "trace"])
def test_an_impossible_header_value_is_a_corrupt_header(
    job, tmp_path, capsys, field, value, command
):
    board = job / "rank0.board"
    _patch(board, HEADER_DTYPE, field, value)
    code, _, err = _run(capsys, *_command(command, job, tmp_path))
    assert code == 1
    line = _one_line(err)
    assert line.startswith(f"ccld: error: {board}: corrupt header (") and str(value) in line


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype, table, field, value", RECORD_VALUES)
@pytest.mark.parametrize("command", ["diagnose", "trace"])
def test_an_impossible_record_value_is_a_corrupt_record(
    job, tmp_path, capsys, dtype, table, field, value, command
):
    """... in every command as ``ccld inspect`` says it."""
    board = job / "rank0.board"
    _patch(board, dtype, field, value, table)
    code, _, err = _run(capsys, *_command("inspect", job, tmp_path))
    said = _one_line(err)
    assert code == 1 and said.startswith(f"ccld: warning: {board}: corrupt records left out (")
    code, _, err = _run(capsys, *_command(command, job, tmp_path))
    assert code == 1 and _one_line(err) == said


def test_a_world_of_two_billion_ranks_is_not_listed(job, capsys):
    """One board of a (corrupt, or huge) world: the ranks without a board are counted,
    never listed or held in a set."""
    (job / "rank1.board").unlink()
    _patch(job / "rank0.board", HEADER_DTYPE, "world", 2**31 - 1)
    code, out, _ = _run(capsys, "diagnose", str(job / "rank0.board"))
    assert code == 0
    assert "no board for 2147483646 ranks ([1, 2, 3" in out.replace("\n", "")


# ------------------------------------------------------------------ corrupt records reported


def _flip_op_bytes(board: Path) -> None:
    """Every op record's byte count made impossible (as a flipped bit would)."""
    data = bytearray(board.read_bytes())
    ring = int(np.frombuffer(data, HEADER_DTYPE, 1)[0]["ring_off"])
    at = OP_DTYPE.fields["bytes"][1]
    for i in range(4):
        data[ring + i * OP_DTYPE.itemsize + at + 6] ^= 0x40
    board.write_bytes(bytes(data))


@pytest.mark.parametrize("command", ["diagnose", "trace"])
def test_corrupt_records_are_said_by_every_command_as_by_inspect(job, tmp_path, capsys, command):
    _flip_op_bytes(job / "rank1.board")
    said = (
        f"ccld: warning: {job / 'rank1.board'}: corrupt records left out (3 ops); the board "
        "is damaged, what is shown passed its checks"
    )
    code, _, err = _run(capsys, *_command("inspect", job, tmp_path))
    assert code == 1 and _one_line(err) == said
    argv = _command(command, job, tmp_path)
    if command == "diagnose":
        argv += ["--jsonl", str(tmp_path / "v.jsonl")]
    code, _, err = _run(capsys, *argv)
    assert code == 1 and _one_line(err) == said
    # what passed its checks is still written
    if command == "diagnose":
        assert (tmp_path / "v.jsonl").is_file()
    elif command == "trace":
        assert json.loads((tmp_path / "out.json").read_text())["traceEvents"]


# ------------------------------------------------------------------ outputs


def test_trace_never_replaces_a_file_unasked(job, tmp_path, capsys):
    out = tmp_path / "out.json"
    out.write_text("precious")
    code, _, err = _run(capsys, *_command("trace", job, tmp_path))
    assert code == 2 and out.read_text() == "precious"
    assert _one_line(err) == (
        f"ccld: error: {out} exists; pass --force to replace it, or give another path"
    )
    code, _, _ = _run(capsys, *_command("trace", job, tmp_path), "--force")
    assert code == 0 and json.loads(out.read_text())["traceEvents"]


@pytest.mark.parametrize("kind", ["fifo", "full", "folder"])
def test_trace_never_writes_into_what_is_no_regular_file(job, tmp_path, capsys, sock_at, kind):
    out = _make(kind, tmp_path / "out.json", sock_at)
    for force in ([], ["--force"]):
        code, _, err = _run(capsys, *_command("trace", job, tmp_path), *force)
        assert code == 2
        what = "a symbolic link" if kind == "full" else KIND_WORDS[kind]  # never followed
        assert (
            _one_line(err) == f"ccld: error: {out}: {what}, not a regular file; give another path"
        )


@pytest.mark.parametrize("command", ["trace", "diagnose", "replay"])
def test_no_folder_is_created_for_an_output(job, recording, tmp_path, capsys, command):
    out = tmp_path / "no" / "such" / "out.json"
    argv = {
        "trace": ["trace", str(job), "-o", str(out)],
        "diagnose": ["diagnose", str(job), "--jsonl", str(out)],
        "replay": ["replay", str(recording), "--jsonl", str(out)],
    }[command]
    code, _, err = _run(capsys, *argv)
    assert code == 2 and not out.parent.exists()
    assert _one_line(err) == (
        f"ccld: error: {out.parent}: the folder does not exist; create it or give another path"
    )


@pytest.mark.parametrize(
    "target, line",
    [
        ("/proc/no-such-process/out.json", "/proc/no-such-process: the folder does not exist"),
        ("/dev/full", "/dev/full: a character device, not a "),
    ],
)
@pytest.mark.parametrize("command", ["trace", "diagnose", "replay"])
def test_an_output_the_system_refuses_is_one_line(job, recording, capsys, command, target, line):
    argv = {
        "trace": ["trace", str(job), "-o", target],
        "diagnose": ["diagnose", str(job), "--jsonl", target],
        "replay": ["replay", str(recording), "--jsonl", target],
    }[command]
    code, _, err = _run(capsys, *argv)
    assert code == 2 and _one_line(err).startswith(f"ccld: error: {line}")


def test_jsonl_appends_to_a_verdicts_file_and_refuses_another_file(recording, tmp_path, capsys):
    verdicts = tmp_path / "v.jsonl"
    assert _run(capsys, "replay", str(recording), "--jsonl", str(verdicts))[0] == 0
    first = verdicts.read_text().splitlines()
    assert [json.loads(v)["kind"] for v in first] == ["hang"]
    assert _run(capsys, "replay", str(recording), "--jsonl", str(verdicts))[0] == 0
    assert verdicts.read_text().splitlines() == first * 2  # appended, nothing lost

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    code, _, err = _run(capsys, "replay", str(recording), "--jsonl", str(notes))
    assert code == 2 and notes.read_text() == "my notes\n"
    assert _one_line(err).startswith(f"ccld: error: {notes}:1: not a JSON line (")
    assert err.rstrip().endswith("give another path, or pass --force to append to it")
    assert _run(capsys, "replay", str(recording), "--jsonl", str(notes), "--force")[0] == 0
    assert notes.read_text().splitlines()[1:] == first


def test_jsonl_after_a_torn_last_line_starts_a_line_of_its_own(job, recording, tmp_path, capsys):
    verdicts = tmp_path / "v.jsonl"
    assert _run(capsys, "replay", str(recording), "--jsonl", str(verdicts))[0] == 0
    whole = verdicts.read_text()
    verdicts.write_text(whole + whole[:40])  # a writer that died mid-record
    assert _run(capsys, "replay", str(recording), "--jsonl", str(verdicts))[0] == 0
    lines = verdicts.read_text().splitlines()
    assert lines == [whole.strip(), whole[:40], whole.strip()]
    # read back: both records, and the torn one said
    code, out, err = _run(capsys, *_command("trace", job, tmp_path), "--verdicts", str(verdicts))
    assert code == 1 and "2 verdict(s)" in out
    assert _one_line(err).startswith(
        f"ccld: warning: {verdicts}: 1 line(s) left out as no verdict records (the first, "
        "line 2: not a JSON line ("
    )


@pytest.mark.parametrize("kind", ["fifo", "full", "null", "folder", "link"])
def test_jsonl_refuses_what_is_no_regular_file_unless_forced(
    recording, tmp_path, capsys, sock_at, kind
):
    if kind == "link":
        target = tmp_path / "elsewhere.jsonl"
        target.write_text("")
        out = tmp_path / "v.jsonl"
        out.symlink_to(target)
        what = "a symbolic link"
    else:
        out = _make(kind, tmp_path / "v.jsonl", sock_at)
        what = KIND_WORDS[kind]
    code, _, err = _run(capsys, "replay", str(recording), "--jsonl", str(out))
    assert code == 2
    assert _one_line(err).startswith(f"ccld: error: {out}: {what}, not a ")
    if kind in ("full", "null"):  # forced: written to; a device's refusal is one line
        code, _, err = _run(capsys, "replay", str(recording), "--jsonl", str(out), "--force")
        if kind == "null":  # (not synced to a disk it does not have)
            assert code == 0 and err == ""
        else:
            assert code == 2
            said = f"ccld: error: {out}: cannot be written (No space left on device)"
            assert _one_line(err) == said


# ------------------------------------------------------------------ verdicts files read


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"\xff\xfe garbage\n", "1: not UTF-8 text (byte 0xff)"),
        (b'{"kind": "hang"\n', "1: not a JSON line (Expecting ',' delimiter)"),
        (b"[1, 2]\n", "1: not a verdict record (a JSON list, not an object)"),
        (b"{}\n", "1: not a verdict record (kind null, cause null)"),
        (
            b'{"kind": "hang", "cause": "compute", "ranks": ["x"], "schema": 2}\n',
            '1: not a verdict record (ranks ["x"])',
        ),
        (
            b'{"kind": "hang", "cause": "compute", "ranks": [0], "onset_s": 1e308}\n',
            "1: not a verdict record (onset_s 1e+308)",
        ),
        (b"[" * 100000 + b"\n", "1: not a JSON line (nested too deep)"),
    ],
)
def test_a_verdicts_file_that_is_not_one_names_its_line(job, tmp_path, capsys, content, problem):
    verdicts = tmp_path / "v.jsonl"
    verdicts.write_bytes(content)
    code, _, err = _run(capsys, *_command("trace", job, tmp_path), "--verdicts", str(verdicts))
    assert code == 2 and not (tmp_path / "out.json").exists()
    assert _one_line(err) == (
        f"ccld: error: {verdicts}:{problem}; expected a verdicts file (JSON lines)"
    )


def test_lines_after_the_first_that_are_no_verdicts_are_left_out_and_said(
    job, recording, tmp_path, capsys
):
    verdicts = tmp_path / "v.jsonl"
    assert _run(capsys, "replay", str(recording), "--jsonl", str(verdicts))[0] == 0
    record = verdicts.read_text()
    # a record, a line of noise, a line too long, a record, and a torn last line
    verdicts.write_text(record + "noise\n" + "x" * (2 << 20) + "\n" + record + record[:30])
    code, out, err = _run(capsys, *_command("trace", job, tmp_path), "--verdicts", str(verdicts))
    assert code == 1 and "2 verdict(s)" in out
    assert _one_line(err) == (
        f"ccld: warning: {verdicts}: 2 line(s) left out as no verdict records (the first, "
        "line 2: not a JSON line (Expecting value)); the others are read"
    )


# ------------------------------------------------------------------ recordings


def test_a_round_that_is_not_as_recorded_is_one_line(recording, tmp_path, capsys):
    import pickle

    bad = tmp_path / "bad.rec"
    frame = {"now_ns": 2**70, "job_start_ns": 0, "world": "2", "values": {0: b""}, "gone": []}
    bad.write_bytes(recording.read_bytes() + pickle.dumps(frame))
    code, _, err = _run(capsys, "replay", str(bad))
    assert code == 2
    assert _one_line(err) == (
        f"ccld: error: {bad}: round 12 is not as recorded (now_ns, world out of range or of "
        "another type)"
    )


@pytest.mark.parametrize("command", ["inspect", "diagnose", "trace"])
def test_a_path_with_a_newline_in_it_is_still_one_line(tmp_path, capsys, command):
    job = _write_job(tmp_path / "a\nb")
    (job / "rank1.board").write_bytes(b"not a board")
    code, _, err = _run(capsys, *_command(command, job, tmp_path))
    assert code == 1
    shown = str(job / "rank1.board").replace("\n", "\\n")
    assert _one_line(err) == (
        f"ccld: error: {shown}: 11 bytes is too small for a board (header alone is "
        f"{HEADER_DTYPE.itemsize}); the file is truncated or foreign"
    )


def test_time_blocked_over_a_whole_ring_of_long_ops_does_not_wrap(tmp_path):
    """A board of another host (its times bounded by MAX_TIME_NS, 2**60, only) whose
    every op lasted ~2**60 ns: each record is possible, their sum is past 64 bits."""
    folder = tmp_path / "j"
    folder.mkdir()
    b = _native.Board(str(folder / "rank0.board"), 0, 1, "j", "elsewhere", 16, 4, 4, 16)
    g = b.register_group(group_id_of((0,)), role_index("dp"), [0], 0)
    for _ in range(16):
        b.exit(b.enter(g, OP_CODES["all_reduce"], 0, 64), 2)
    b.close(unlink=False)
    data = bytearray((folder / "rank0.board").read_bytes())
    header = np.frombuffer(bytes(data), HEADER_DTYPE, 1)[0]
    ring = np.frombuffer(data, OP_DTYPE, 16, int(header["ring_off"]))
    ring["exit_ns"] = 2**60
    (folder / "rank0.board").write_bytes(bytes(data))
    boards = load_boards(folder)
    (progress,) = job_view(boards, load_config(None, writing=False)).summaries[0].groups
    expected = sum(2**60 - int(t) for t in ring["enter_ns"]) // 1000
    assert progress.blocked_us == pytest.approx(expected, rel=1e-9)
