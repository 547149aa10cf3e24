"""The DeepSpeed integration on real DeepSpeed jobs (CPU accelerator, gloo).

Each job runs ``examples/deepspeed/train.py`` with one process per rank and keeps its
boards (``board.cleanup=false``) in a temporary directory, which the tests then read. On 2
shared cores a 4-rank job takes ~15-25 s, mostly importing torch and DeepSpeed per rank.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from job_runner import JobResult, run_job
from paths import REPO

from ccld_plugin.board.reader import BoardReader
from ccld_plugin.wire.codes import OP_NAMES

pytest.importorskip("deepspeed")

__all__: list[str] = []

EXAMPLE = REPO / "examples" / "deepspeed" / "train.py"
DS_CONFIG = REPO / "examples" / "deepspeed" / "ds_config.json"
ENV = {
    "DS_ACCELERATOR": "cpu",
    "CUDA_VISIBLE_DEVICES": "",
    "TORCHDYNAMO_DISABLE": "1",
    "PYTHONWARNINGS": "ignore",
}
STEPS = 3
HIDDEN = 64
JOB = "ds"
# Gradient and parameter bytes of the example's dense layers (fp32): two blocks of
# Linear(h, 4h) + Linear(4h, h); the MoE variant adds the gate, Linear(h, 4 experts).
DENSE_BYTES = 4 * 2 * (HIDDEN * 4 * HIDDEN + 4 * HIDDEN + 4 * HIDDEN * HIDDEN + HIDDEN)
GATE_BYTES = 4 * HIDDEN * 4
# Two local experts of Linear(h, 2h) + Linear(2h, h) each.
EXPERT_BYTES = 4 * 2 * (HIDDEN * 2 * HIDDEN + 2 * HIDDEN + 2 * HIDDEN * HIDDEN + HIDDEN)


def train(
    tmp: Path, world: int, *args: str, config: Path = DS_CONFIG, env: dict[str, str] = ENV
) -> JobResult:
    boards = tmp / "boards"
    sets = [f"board.dir={boards}", "board.cleanup=false", f"job={JOB}"]
    argv = [
        "--deepspeed_config",
        str(config),
        "--steps",
        str(STEPS),
        "--hidden",
        str(HIDDEN),
        *args,
        *[a for s in sets for a in ("--ccld-set", s)],
    ]
    return run_job(str(EXAMPLE), world, tmp, tuple(argv), env=env, timeout_s=150)


class Board:
    """One rank's board after the job: its groups by role and its ops per step."""

    def __init__(self, path: Path) -> None:
        with BoardReader(path) as r:
            self.header = r.header()
            groups = r.groups()
            ops = r.ops()
        self.roles = defaultdict(set)
        role_of = {}
        for g in groups:
            self.roles[g.role].add(g.ranks)
            role_of[g.group_id] = (g.role, g.ranks)
        self.ops = [
            (int(o["step"]), OP_NAMES[int(o["op"])], *role_of[int(o["group_id"])], int(o["bytes"]))
            for o in ops
        ]

    def group(self, role: str) -> tuple[int, ...]:
        assert len(self.roles[role]) == 1, f"{role}: {self.roles}"
        return next(iter(self.roles[role]))

    def on(self, step: int, role: str) -> list[tuple[str, int]]:
        """(op, bytes) of the ops of ``step`` on the group of ``role``."""
        return [(op, n) for s, op, r, _, n in self.ops if s == step and r == role]


def boards(tmp: Path, world: int) -> list[Board]:
    return [Board(tmp / "boards" / JOB / f"rank{r}.board") for r in range(world)]


def results(job: JobResult, world: int) -> list[dict]:
    return [job.json_lines(r, "result")[-1] for r in range(world)]


def check_steps(b: Board) -> None:
    """Steps 0..STEPS were marked: one per optimizer step, the last one started."""
    assert b.header.step == STEPS
    assert sorted({s for s, *_ in b.ops}) == list(range(STEPS + 1))


def check_zero_ops(b: Board, role: str, gather_bytes: int, reduce_ops: set[str]) -> None:
    """Every training step after warm-up reduces the full gradient and all-gathers the full
    parameters on the ZeRO group (``role``), under the names DeepSpeed called."""
    for step in range(1, STEPS):
        ops = b.on(step, role)
        assert sum(n for op, n in ops if op in reduce_ops) >= DENSE_BYTES, (step, ops)
        assert sum(n for op, n in ops if op == "all_gather_into_tensor") >= gather_bytes, (
            step,
            ops,
        )
        # TorchBackend's captured all_gather_into_tensor / reduce_scatter_tensor were
        # rebound: unwrapped, torch 2.13 would show their inner *_single call instead.
        assert not [op for op, _ in ops if op.endswith("_single")], ops


def test_zero2_groups_with_roles_and_ops(tmp_path: Path) -> None:
    """ccld_plugin.deepspeed.initialize, ZeRO-2, MoE with expert parallel 2."""
    world = 4
    job = train(tmp_path, world, "--zero-stage", "2", "--moe").check()
    assert all(r["ccld"] and r["traced"] and r["zero_stage"] == 2 for r in results(job, world))
    for rank, b in enumerate(boards(tmp_path, world)):
        check_steps(b)
        assert b.group("dp") == (0, 1, 2, 3)
        ep, edp = b.group("ep"), b.group("other")  # expert DP is "other" by design
        assert len(ep) == len(edp) == 2 and set(ep) & set(edp) == {rank}
        check_zero_ops(b, "dp", DENSE_BYTES + GATE_BYTES, {"all_reduce", "reduce"})
        for step in range(1, STEPS):
            assert ("all_reduce", EXPERT_BYTES) in b.on(step, "other")
            assert any(op == "all_to_all_single" for op, _ in b.on(step, "ep"))


def test_zero3_late_install_sees_backend_captures(tmp_path: Path) -> None:
    """Plain deepspeed.initialize, then install(engine), where the start-up hook is off
    (with it, deepspeed.initialize reads the block itself): ZeRO-3's gathers and
    reduce-scatters go through the functions TorchBackend captured at init."""
    world = 4
    hook_off = {**ENV, "CCLD_AUTOLOAD": "0"}
    job = train(tmp_path, world, "--zero-stage", "3", "--install", "late", env=hook_off).check()
    assert all(r["ccld"] and r["zero_stage"] == 3 for r in results(job, world))
    for b in boards(tmp_path, world):
        check_steps(b)
        assert b.group("dp") == (0, 1, 2, 3)
        check_zero_ops(b, "dp", DENSE_BYTES, {"reduce_scatter_tensor"})


def test_zero3_enable_first_with_sequence_parallel(tmp_path: Path) -> None:
    """ccld_plugin.enable() before deepspeed.initialize (the launcher form), ZeRO-3 on a
    DP2 x SP2 mesh: cp and dp roles, and ZeRO-3's DP x SP group as dp_cp."""
    world = 4
    train(tmp_path, world, "--zero-stage", "3", "--sp", "2", "--install", "enable-first").check()
    for rank, b in enumerate(boards(tmp_path, world)):
        check_steps(b)
        assert b.group("dp") == (rank % 2, rank % 2 + 2)
        assert b.group("cp") == (rank // 2 * 2, rank // 2 * 2 + 1)
        assert b.group("dp_cp") == (0, 1, 2, 3)
        check_zero_ops(b, "dp_cp", DENSE_BYTES, {"reduce_scatter_tensor"})


def test_disabled_block_wraps_nothing(tmp_path: Path) -> None:
    world = 2
    job = train(tmp_path, world, "--zero-stage", "2", "--ccld-set", "enabled=false").check()
    for r in results(job, world):
        assert r["ccld"] is False and r["traced"] is False and r["steps"] == STEPS
    assert not (tmp_path / "boards").exists()


def test_bad_value_stops_at_start(tmp_path: Path) -> None:
    config = json.loads(DS_CONFIG.read_text())
    config["ccld"]["agent"] = {"interval_s": 0}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    world = 2
    job = train(tmp_path, world, config=path)
    assert job.codes == [2] * world
    for log in job.logs:
        lines = [line for line in log.splitlines() if "ccld config" in line]
        assert lines == ["ccld config: agent.interval_s=0.0 is not allowed; expected 0.05..60"]
        assert "Traceback" not in log and "step 1/" not in log
    assert not (tmp_path / "boards").exists()
