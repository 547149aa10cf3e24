"""The NCCL profiler plugin inside live gloo jobs: tests/native/nccl_harness.c, built as a
library, raises NCCL-shaped events in every rank while the installed plugin (agent,
control plane, diagnoser, JSONL sink as they run) turns them into verdicts. Not a run of a
real NCCL: see tests/native/test_nccl_profiler.py for the interface itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cbuild import compile_c
from paths import NATIVE_TESTS

HARNESS_SRC = NATIVE_TESTS / "nccl_harness.c"

# The fault nccl_harness.c spreads over its ring (ring_fault), as NCCL's steps spread it.
FAULT_NONE, FAULT_GPU, FAULT_CREDIT, FAULT_LINK = 0, 1, 2, 3


@pytest.fixture(scope="module")
def harness_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nccl_harness.c as a library that raises NCCL's events inside a live job (the job's
    own plugin is the installed one, which NCCL_PROFILER_PLUGIN names)."""
    lib = tmp_path_factory.mktemp("nccl_harness") / "libnccl_harness.so"
    compile_c(
        lib,
        [HARNESS_SRC],
        "-Wall",
        "-Wno-unused-function",
        "-DCCLD_HARNESS_LIB",
        shared=True,
        libs=("-ldl",),
    )
    return lib


@pytest.mark.parametrize(
    ("fault", "where", "ranks", "cause"),
    [
        (FAULT_GPU, 1, [2], "compute"),
        (FAULT_LINK, 2, [1, 3], "communication"),  # global 3 -> 1, the ring's wrap-around
        (FAULT_NONE, 0, None, None),
    ],
)
def test_live_job_names_the_fault_from_nccl_channels(
    harness_lib: Path,
    tmp_path: Path,
    fault: int,
    where: int,
    ranks: list[int] | None,
    cause: str | None,
) -> None:
    """A real 4-rank gloo job (agent, control plane, diagnoser, JSONL sink as they run)
    whose ranks 1-3 run one all-reduce through the plugin: the verdict comes from the
    plugin's channel records on the ranks' boards, and a fault-free run has none."""
    from job_runner import facts, run_job

    from ccld_plugin.sinks.jsonl import read_verdicts

    out = tmp_path / "job"
    res = run_job(
        "nccl_ring_fault.py",
        4,
        out,
        (str(harness_lib), str(fault), str(where), str(out)),
        timeout_s=120,
    ).check()
    for r in (1, 2, 3):
        assert res.json_lines(r, "HARNESS") == [{"bad_returns": 0}]
    verdicts = read_verdicts(out / "verdicts.jsonl")
    if fault == FAULT_NONE:
        assert verdicts == []
        return
    assert len(verdicts) == 1, verdicts
    v = verdicts[0]
    assert (v["kind"], v["cause"], v["ranks"]) == ("hang", cause, ranks), v["evidence"]
    assert v["group"]["role"] == "dp" and v["group"]["ranks"] == [1, 2, 3]
    assert v["op"] == "all_reduce" and v.get("link") == (ranks if fault == FAULT_LINK else None)
    waits = facts(v["evidence"])["nccl_wait"]
    assert all(w["data"]["conns"] >= 1 and w["data"]["stalled_s"] >= 1.0 for w in waits)
    if cause == "compute":  # where the culprit's host thread is
        assert v["stack"] and any("nccl_ring_fault.py" in f for f in v["stack"])


@pytest.mark.parametrize("slow_rank", [1, -1])
def test_live_job_names_a_slow_nccl_link(harness_lib: Path, tmp_path: Path, slow_rank: int) -> None:
    """A real 4-rank gloo job running one NCCL-shaped ring all-reduce per step: when rank
    1's send steps spend 25x longer handed to the network, the plugin's per-link totals
    make the running diagnoser name the link 1 -> 2; a fault-free run has no verdict."""
    from job_runner import facts, run_job

    from ccld_plugin.sinks.jsonl import read_verdicts

    out = tmp_path / "job"
    run_job(
        "nccl_ring_slow.py", 4, out, (str(harness_lib), str(slow_rank), str(out)), timeout_s=180
    ).check()
    verdicts = read_verdicts(out / "verdicts.jsonl")
    if slow_rank < 0:
        assert verdicts == []
        return
    assert len(verdicts) == 1, verdicts
    v = verdicts[0]
    assert (v["kind"], v["cause"], v["ranks"], v["link"]) == (
        "slow",
        "communication",
        [1, 2],
        [1, 2],
    ), v["evidence"]
    assert v["group"]["ranks"] == [0, 1, 2, 3]
    links = facts(v["evidence"])["nccl_link_slow"]
    assert any((e["data"]["rank"], e["data"]["peer"]) == (1, 2) for e in links)


# ----------------------------------------------------------------------------- python side


def test_config_key_sets_the_plugin_env_before_nccl_starts(tmp_path):
    """``nccl_profiler: true`` points NCCL_PROFILER_PLUGIN at the library the extension
    loaded, as soon as the plugin is enabled (before init_process_group here)."""
    code = (
        "import os, ccld_plugin\n"
        "from ccld_plugin.tracing.nccl_env import nccl_plugin_path\n"
        "os.environ.pop('NCCL_PROFILER_PLUGIN', None)\n"
        "ccld_plugin.enable(overrides=['nccl_profiler=true'])\n"
        "assert os.environ['NCCL_PROFILER_PLUGIN'] == nccl_plugin_path(), os.environ\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
