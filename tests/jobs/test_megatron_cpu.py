"""Real megatron-core training on CPU (gloo), launched with torchrun.

Each job runs ``examples/megatron/pretrain_gpt.py`` in its own torchrun on a free port,
forced onto the CPU path (``CUDA_VISIBLE_DEVICES=""``), with one thread per rank.
On 2 shared cores a 4-rank job takes ~15-35 s (mostly importing torch and Megatron in
every rank). The 8-rank TP2 x PP2 x DP2 and the TP1 x PP2 x EP2 MoE layouts, with the
distributed optimizer, train in test_megatron_plugin.py, which checks their groups and
collectives on the boards.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest
from paths import REPO

from ccld_harness.launch import free_port

pytest.importorskip("megatron.core")

__all__: list[str] = []

SCRIPT = REPO / "examples" / "megatron" / "pretrain_gpt.py"
ITERATION = re.compile(r"^iteration (\d+)/(\d+) \| loss (\S+) \| grad norm (\S+)", re.M)
GROUPS = re.compile(r"^groups (\{.*\})$", re.M)


def _cpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",  # the CPU path, even on a GPU machine
        TORCHDYNAMO_DISABLE="1",  # skips ~2 s of torch.compile setup per rank
        PYTHONWARNINGS="ignore",
    )
    return env


def _run(cmd: list[str], timeout: float) -> str:
    """Run in a new session so a timeout can kill torchrun and every rank it started."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-6000:]}"
    return out


def torchrun(nproc: int, *args: str, timeout: float = 150) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd += [str(SCRIPT), "--dist-timeout-s", "120", *args]
    return _run(cmd, timeout)


def losses(out: str, iters: int) -> list[float]:
    """The loss of every iteration line; exactly one line per iteration."""
    found = [(int(i), int(n), float(loss)) for i, n, loss, _ in ITERATION.findall(out)]
    assert [(i, n) for i, n, _ in found] == [(i, iters) for i in range(1, iters + 1)], out[-3000:]
    values = [loss for _, _, loss in found]
    assert all(math.isfinite(v) for v in values), values
    return values


def groups_by_rank(out: str) -> dict[int, dict[str, list[list[int]]]]:
    """{rank: {role: [ranks of each group with that role]}} from the --print-groups lines."""
    result: dict[int, dict[str, list[list[int]]]] = {}
    for line in GROUPS.findall(out):
        record = json.loads(line)
        roles: dict[str, list[list[int]]] = {}
        for role, ranks in record["groups"]:
            roles.setdefault(role, []).append(ranks)
        result[record["rank"]] = roles
    return result


@pytest.fixture(scope="module")
def tp2_pp2() -> str:
    # One job serves the training and the groups tests: a launch costs most of the time.
    return torchrun(
        4,
        "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2",
        "--train-iters", "3",
        "--print-groups",
    )  # fmt: skip


def test_tp2_pp2_trains(tp2_pp2: str) -> None:
    values = losses(tp2_pp2, 3)
    # Random init over 128 tokens starts near ln(128) = 4.85.
    assert 3.0 < values[0] < 6.0, values


def test_tp2_pp2_groups(tp2_pp2: str) -> None:
    # megatron-core 0.16.1 orders ranks "tp-cp-ep-dp-pp" (tp fastest): with TP2 x PP2 on 4
    # ranks, TP pairs are neighbours and pipelines stride by TP.
    groups = groups_by_rank(tp2_pp2)
    assert sorted(groups) == [0, 1, 2, 3]
    for rank, roles in groups.items():
        tp = [rank - rank % 2, rank - rank % 2 + 1]
        pp = [rank % 2, rank % 2 + 2]
        assert roles["tp"] == [tp]
        assert roles["pp"] == [pp]
        assert roles["dp"] == [[rank]]  # DP = 1
        assert roles["dp_cp"] == [[rank]]
        assert roles["cp"] == [[rank]]
        assert roles["ep"] == [[rank]]
        assert roles["etp"] == [tp]  # expert TP defaults to TP
        assert roles["embd"] == [pp]  # first and last stage share tied embeddings
        if rank in (0, 1):  # first stage only
            assert roles["pos_embd"] == [[rank]]
        else:
            assert "pos_embd" not in roles
        assert roles["mp"] == [[0, 1, 2, 3]]  # the model-parallel (TP x PP) group
        assert set(roles) <= {"tp", "pp", "dp", "dp_cp", "cp", "ep", "etp", "embd", "pos_embd",
                              "mp", "other"}  # fmt: skip


def test_tp2_cp2_groups() -> None:
    # Groups only (the local layer spec cannot train with CP > 1): here "dp" and "dp_cp"
    # differ, which TP2 x PP2 cannot show.
    out = torchrun(
        4,
        "--tensor-model-parallel-size", "2",
        "--context-parallel-size", "2",
        "--train-iters", "0",
        "--print-groups",
    )  # fmt: skip
    groups = groups_by_rank(out)
    assert sorted(groups) == [0, 1, 2, 3]
    for rank, roles in groups.items():
        assert roles["tp"] == [[rank - rank % 2, rank - rank % 2 + 1]]
        assert roles["cp"] == [[rank % 2, rank % 2 + 2]]  # CP strides by TP
        assert roles["dp_cp"] == [[rank % 2, rank % 2 + 2]]  # DP = 1, so DP x CP = CP
        assert roles["dp"] == [[rank]]
        assert roles["pp"] == [[rank]]


def test_compat_layer_activation() -> None:
    # In a subprocess: activate() patches torch for the whole process.
    code = """
import megatron.core, torch
from ccld_harness import megatron_cpu as m
real = torch.cuda.is_available
torch.cuda.is_available = lambda: True
assert m.activate() is False and not m.is_active(), "must stay off where CUDA exists"
torch.cuda.is_available = real
assert m.activate() is True and m.is_active()
assert m.activate() is True  # idempotent
t = torch.zeros(2, device="cuda")
assert t.device.type == "cpu" and t.type() == "torch.cuda.FloatTensor"
assert torch.ones(1).cuda().device.type == "cpu"
assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
torch.cuda.synchronize()
print("ok")
"""
    assert _run([sys.executable, "-c", code], timeout=90).strip().endswith("ok")


def test_groups_empty_before_init() -> None:
    from ccld_plugin.integrations.megatron.groups import parallel_state_groups

    assert parallel_state_groups() == []
