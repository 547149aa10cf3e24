"""What ``ccld demo`` accepts before it launches anything: a world the host can run, and
an ``--out`` folder no live demo holds (its hold a real lock on a real file, tried twice
in this one process: flock locks belong to each opening of the file)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ccld_harness import capacity
from ccld_harness.demo import MARKER, _holding
from ccld_harness.options import DemoError, DemoOptions, checked_options
from ccld_harness.stop_signals import Stopped, StopRequest

GIB = 1 << 30


def test_the_scarcer_of_memory_and_tasks_bounds_the_world() -> None:
    by_memory = capacity.ranks_that_fit("megatron", 20 * GIB, 100_000)
    assert by_memory.ranks == 20 * 1024 // 400
    assert by_memory.why == "20.0 GiB of memory available, 400 MiB per rank"
    by_tasks = capacity.ranks_that_fit("megatron", 20 * GIB, 800)
    assert (
        by_tasks.ranks == 10 and "room for 800 more processes/threads, 80 per rank" in by_tasks.why
    )
    assert capacity.ranks_that_fit("deepspeed", 100 << 20, 10**6).ranks == 0
    assert capacity.ranks_that_fit("torch", -1, -1).ranks == 0


def test_this_hosts_room_is_read() -> None:
    total = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    assert 0 < capacity.memory_available() <= total
    assert 0 < capacity.tasks_free() <= int(Path("/proc/sys/kernel/pid_max").read_text())


@pytest.mark.parametrize("framework", ["torch", "megatron", "deepspeed"])
def test_a_world_above_the_hosts_bound_is_refused(framework: str) -> None:
    bound = capacity.host_capacity(framework).ranks
    opts = DemoOptions(framework=framework, world=100_000, tp=1, pp=1, faults=["none"])
    with pytest.raises(DemoError) as err:
        checked_options(opts)
    line = str(err.value)
    assert line.startswith("ccld demo: --world 100000 is more than this host can run: at most ")
    assert f" {framework} ranks (" in line and line.endswith("; lower --world")
    assert bound < 100_000


def test_out_held_by_a_live_demo_is_refused_and_untouched(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with _holding(out, force=False):
        (out / "logs").mkdir()
        (out / "logs" / "rank0.log").write_text("live")
        (out / "summary.json").write_text("{}")
        with pytest.raises(DemoError) as err, _holding(out, force=True):
            pass
        assert str(err.value) == (
            f"ccld demo: --out {out} is in use by another demo still running (pid "
            f"{os.getpid()}); wait for it to end, or choose another --out"
        )
        assert (out / "logs" / "rank0.log").read_text() == "live"
        assert (out / "summary.json").exists()
    # released: the next run takes the folder over and replaces the outputs
    with _holding(out, force=False):
        assert not (out / "logs").exists() and not (out / "summary.json").exists()


def test_out_with_a_missing_parent_or_a_planted_marker_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "a" / "b"
    with (
        pytest.raises(DemoError, match="does not exist; create it first"),
        _holding(missing, False),
    ):
        pass
    assert not (tmp_path / "a").exists()
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "target"
    target.write_text("someone's file")
    (out / MARKER).symlink_to(target)
    planted = "in it is a symbolic link; choose another --out"
    with pytest.raises(DemoError, match=planted), _holding(out, force=True):
        pass
    assert target.read_text() == "someone's file"


def test_a_stop_request_is_the_first_signal() -> None:
    stop = StopRequest()
    assert not stop
    stop.check()
    stop.record(signal.SIGINT)
    stop.record(signal.SIGTERM)
    assert stop and stop.name == "SIGINT" and stop.exit_code == 130
    with pytest.raises(Stopped, match="stopped by SIGINT"):
        stop.check()
