"""The Megatron integration on real megatron-core jobs (CPU, gloo): ``--ccld`` end to end.

Each job runs examples/megatron/pretrain_gpt.py through tests/scripts/megatron_gpt.py (the
example plus two probe lines), one process per rank, and keeps its boards so that the
groups and ops the plugin recorded can be read back after the job. One job per layout
serves several tests: on 2 shared cores a launch costs most of the time (a 4-rank job
~20-30 s, the 8-rank one ~60 s).

What a board shows: one entry per set of ranks, with the most specific role registered
for it (``topology.more_specific``: the first non-generic role wins). So groups that
Megatron builds separately but with the same ranks share an entry: with DP = 1 the
singleton groups (dp, dp_cp, cp, ep, pos_embd) read as "dp", etp reads as "tp", embd as
"pp", and a model-parallel group that spans the world reads as "world".
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from job_runner import JobResult, run_job  # noqa: E402

from ccld_plugin.board.reader import BoardReader  # noqa: E402
from ccld_plugin.wire.codes import OP_NAMES

__all__: list[str] = []

ITERS = 2
# Small and quick: 1 layer per stage, 2 micro-batches per iteration.
COMMON = (
    "--train-iters",
    str(ITERS),
    "--num-layers",
    "2",
    "--num-microbatches",
    "2",
    "--dist-timeout-s",
    "120",
)
ENV = {"TORCHDYNAMO_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
JOB = "megatron"
REDUCE_SCATTER = {"reduce_scatter_tensor", "reduce_scatter_single"}
ALL_GATHER = {"all_gather_into_tensor", "all_gather_single"}


def _job(
    out: Path, world: int, *args: str, env: dict[str, str] | None = None, timeout_s: float = 150
) -> JobResult:
    return run_job(
        "megatron_gpt.py",
        world,
        out,
        args=(*COMMON, *args),
        env={**ENV, **(env or {})},
        timeout_s=timeout_s,
    )


def _traced_job(out: Path, world: int, *args: str, timeout_s: float = 150) -> JobResult:
    return _job(
        out,
        world,
        "--ccld",
        "--ccld-set",
        f"board.dir={out / 'boards'}",
        "--ccld-set",
        "board.cleanup=false",
        "--ccld-set",
        f"job={JOB}",
        *args,
        timeout_s=timeout_s,
    ).check()


def _board(res: JobResult, rank: int) -> BoardReader:
    return BoardReader(res.out / "boards" / JOB / f"rank{rank}.board")


def _groups(res: JobResult, rank: int) -> dict[str, list[tuple[int, ...]]]:
    with _board(res, rank) as b:
        found: dict[str, list[tuple[int, ...]]] = {}
        for g in b.groups():
            found.setdefault(g.role, []).append(g.ranks)
    return found


def _ops(res: JobResult, rank: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(op name, group ranks, step, bytes) of every op on the rank's board, oldest first."""
    with _board(res, rank) as b:
        ranks = {g.group_id: g.ranks for g in b.groups()}
        return [
            (OP_NAMES[int(o["op"])], ranks[int(o["group_id"])], int(o["step"]), int(o["bytes"]))
            for o in b.ops()
        ]


def _check_tracing(res: JobResult, world: int) -> None:
    """Every rank traced, marked every iteration, and saw Megatron's captured references."""
    for rank in range(world):
        (probe,) = res.json_lines(rank, "PROBE")
        assert probe["session"], probe
        assert all(probe["traced"].values()), probe["traced"]
        with _board(res, rank) as b:
            assert b.header().step == ITERS - 1
        assert {step for _, _, step, _ in _ops(res, rank)} >= set(range(ITERS))


def _check_bucket_collectives(res: JobResult, rank: int, dp: tuple[int, ...]) -> None:
    """The distributed optimizer's bucket reduce-scatter and all-gather are on the board,
    on the dp group, in every iteration.

    Megatron issues them inside ``_coalescing_manager`` with the functions it captured at
    import. The tracer records such a block as one "coalesced" op whose bytes come only
    from inner calls that reached a wrapper, so bytes > 0 shows the inner ops were traced.
    (That the captured references themselves are the wrappers is the PROBE line's part:
    torch 2.13's reduce_scatter_tensor calls the wrapped reduce_scatter_single anyway.)
    """
    on_dp = [(name, step, nbytes) for name, ranks, step, nbytes in _ops(res, rank) if ranks == dp]
    for step in range(ITERS):
        names = {name for name, s, _ in on_dp if s == step}
        if names & REDUCE_SCATTER:  # a tracer that records the inner ops by name
            assert names & ALL_GATHER, (rank, step, names)
            continue
        # (A named all_gather_into_tensor on these ranks can be MoE token counts.)
        blocks = [nbytes for name, s, nbytes in on_dp if s == step and name == "coalesced"]
        assert len(blocks) >= 2, (rank, step, on_dp)  # a reduce-scatter and an all-gather
        assert all(nbytes > 0 for nbytes in blocks), (rank, step, blocks)


# ------------------------------------------------------------------------- TP2 x PP2
@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    return _traced_job(
        tmp_path_factory.mktemp("tp2pp2"),
        4,
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    )


def test_tp2_pp2_groups_on_boards(tp2_pp2: JobResult) -> None:
    # Rank order tp-cp-ep-dp-pp (TP fastest): TP pairs are neighbours, pipelines stride 2.
    for rank in range(4):
        assert _groups(tp2_pp2, rank) == {
            "world": [(0, 1, 2, 3)],  # also the model-parallel (TP x PP) group
            "tp": [(rank - rank % 2, rank - rank % 2 + 1)],  # also etp
            "pp": [(rank % 2, rank % 2 + 2)],  # also embd: first and last stage
            "dp": [(rank,)],  # DP = 1: also dp_cp, cp, ep, pos_embd
        }


def test_tp2_pp2_traces_every_rank(tp2_pp2: JobResult) -> None:
    _check_tracing(tp2_pp2, 4)
    for rank in range(4):
        ops = Counter((name, ranks) for name, ranks, _, _ in _ops(tp2_pp2, rank))
        tp = (rank - rank % 2, rank - rank % 2 + 1)
        pp = (rank % 2, rank % 2 + 2)
        assert ops[("all_reduce", tp)] > 0  # row-parallel layers
        # Activations forward and gradients back through the pipeline.
        assert ops[("isend", pp)] + ops[("batch_isend_irecv", pp)] > 0
        assert ops[("irecv", pp)] + ops[("batch_isend_irecv", pp)] > 0


# ------------------------------------------------------------------------- EP2 MoE
@pytest.fixture(scope="module")
def ep2_moe(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    return _traced_job(
        tmp_path_factory.mktemp("ep2moe"),
        4,
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "2",
        "--expert-model-parallel-size",
        "2",
        "--num-experts",
        "4",
        "--use-distributed-optimizer",
    )


def test_ep2_moe_groups_on_boards(ep2_moe: JobResult) -> None:
    for rank in range(4):
        pair = (rank - rank % 2, rank - rank % 2 + 1)
        groups = _groups(ep2_moe, rank)
        # EP2 sits inside the 2-way DP of one stage: the ep and dp groups have the same
        # ranks, so they share one board entry (role "dp", registered first).
        ep_or_dp = groups.get("ep", []) + groups.get("dp", [])
        assert ep_or_dp == [pair], groups
        assert groups["world"] == [(0, 1, 2, 3)]
        assert groups["pp"] == [(rank % 2, rank % 2 + 2)]  # also mp (TP = 1) and embd
        assert groups["tp"] == [(rank,)]  # TP = 1: also etp, cp, expert-dp
        # The token dispatcher's all-to-all runs on the expert-parallel ranks.
        assert (
            Counter(n for n, ranks, _, _ in _ops(ep2_moe, rank) if ranks == pair)[
                "all_to_all_single"
            ]
            > 0
        )


def test_ep2_moe_distributed_optimizer_buckets_traced(ep2_moe: JobResult) -> None:
    _check_tracing(ep2_moe, 4)
    for rank in range(4):
        _check_bucket_collectives(ep2_moe, rank, (rank - rank % 2, rank - rank % 2 + 1))


# ------------------------------------------------------------------------- TP2 x PP2 x DP2
@pytest.mark.slow
def test_tp2_pp2_dp2_distributed_optimizer(tmp_path: Path) -> None:
    res = _traced_job(
        tmp_path,
        8,
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        timeout_s=240,
    )
    _check_tracing(res, 8)
    for rank in range(8):
        stage_base = 4 * (rank // 4)
        dp = (rank % 2 + stage_base, rank % 2 + stage_base + 2)  # DP strides by TP
        mp = tuple(sorted({(rank % 4) // 2 * 2 + d for d in (0, 1, 4, 5)}))
        assert _groups(res, rank) == {
            "world": [tuple(range(8))],
            "tp": [(rank - rank % 2, rank - rank % 2 + 1)],
            "pp": [(rank % 4, rank % 4 + 4)],  # PP strides by TP x DP
            "dp": [dp],  # also dp_cp (CP = 1) and expert-dp (EP = 1)
            "mp": [mp],  # TP x PP: one model replica
            "cp": [(rank,)],  # CP = 1: also ep, pos_embd
            "other": [tuple(range(stage_base, stage_base + 4))],  # TP x DP of one stage
        }
        _check_bucket_collectives(res, rank, dp)


# ------------------------------------------------------------------------- plugin off
def test_without_ccld_nothing_is_traced(tmp_path: Path) -> None:
    # The fault injector is still wired (its onset is logged) though nothing is traced.
    fault_log = tmp_path / "faults.jsonl"
    res = _job(
        tmp_path,
        1,
        "--ccld-set",
        f"board.dir={tmp_path / 'boards'}",
        env={"CCLD_FAULTS": "compute-slow@0:factor=1.5,step=1", "CCLD_FAULT_LOG": str(fault_log)},
    ).check()
    (probe,) = res.json_lines(0, "PROBE")
    assert not probe["session"]
    assert not any(probe["traced"].values()), probe["traced"]
    assert not (tmp_path / "boards").exists()
    assert "--ccld-set given without --ccld" in res.logs[0]
    (onset,) = [line for line in fault_log.read_text().splitlines() if line]
    assert '"step": 1' in onset and '"rank": 0' in onset


def test_bad_ccld_set_key_stops_with_one_line(tmp_path: Path) -> None:
    res = _job(tmp_path, 1, "--ccld", "--ccld-set", "board.nosuch=1", timeout_s=90)
    assert res.codes == [1], res.logs[0][-2000:]
    log = res.logs[0]
    errors = [line for line in log.splitlines() if "board.nosuch" in line]
    assert len(errors) == 1, log[-2000:]
    assert "unknown key 'board.nosuch'" in errors[0] and "allowed keys" in errors[0]
    assert "Traceback" not in log and not re.search(r"^iteration \d", log, re.M)
