"""``ccld run`` under ``srun``: torch.distributed's variables from the ones srun sets in each
task, never over one that is set, and not for a launcher that sets them itself."""

from __future__ import annotations

import pytest

from ccld_plugin.cli import main
from ccld_plugin.integrations.launch_world import is_launcher
from ccld_plugin.integrations.slurm import (
    SlurmError,
    expand_counts,
    expand_hostlist,
    torch_env_from_slurm,
)

# task 5 of 8, the second on its node, in a step over 2 nodes of 4 tasks each
TASK = {
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "16",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_TASKS_PER_NODE": "8(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[05-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
}


def test_host_lists_and_counts_expand_as_slurm_writes_them():
    assert expand_hostlist("gpu[01-03,10],login7,a[8-9]b") == [
        "gpu01",
        "gpu02",
        "gpu03",
        "gpu10",
        "login7",
        "a8b",
        "a9b",
    ]
    assert expand_hostlist("10.0.0.1,10.0.0.2") == ["10.0.0.1", "10.0.0.2"]
    assert expand_counts("4(x2),3") == [4, 4, 3]
    for bad in ("gpu[01-x]", "gpu[1-2]x[3]"):
        with pytest.raises(SlurmError):
            expand_hostlist(bad)
    with pytest.raises(SlurmError, match="'4x2' is not N or N"):
        expand_counts("4x2")


def test_a_tasks_variables_from_the_steps():
    assert torch_env_from_slurm(TASK) == {
        "RANK": "5",
        "WORLD_SIZE": "8",  # the step's tasks, not the job's
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu07",  # the step's first node
        "MASTER_PORT": "18456",  # 15000 + job id % 10000
    }
    # the job's variables where the step's are absent (an older srun)
    job_only = {k: v for k, v in TASK.items() if "STEP" not in k} | {"SLURM_NODEID": "0"}
    env = torch_env_from_slurm(job_only)
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"]) == ("16", "8", "gpu05")


def test_set_variables_win_and_torch_launched_tasks_are_left_alone():
    env = torch_env_from_slurm({**TASK, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"})
    assert "MASTER_ADDR" not in env and "MASTER_PORT" not in env and env["RANK"] == "5"
    assert torch_env_from_slurm({**TASK, "RANK": "0"}) == {}  # torchrun's worker
    assert torch_env_from_slurm({"RANK": "3"}) == {} == torch_env_from_slurm({})  # no srun
    assert is_launcher(["torchrun", "--nproc-per-node", "4", "t.py"])
    assert is_launcher(["/x/bin/python3", "-u", "-m", "torch.distributed.run", "t.py"])
    assert is_launcher(["deepspeed", "t.py"])
    assert not is_launcher(["python", "t.py"]) and not is_launcher(["srun", "python", "t.py"])


def test_variables_that_cannot_be_read_are_one_line(capsys):
    with pytest.raises(SlurmError, match="SLURM_PROCID='x' is not a number"):
        torch_env_from_slurm({**TASK, "SLURM_PROCID": "x"})
    with pytest.raises(SlurmError, match="not below the step's 8 tasks"):
        torch_env_from_slurm({**TASK, "SLURM_PROCID": "8"})
    with pytest.raises(SlurmError, match="set MASTER_ADDR"):
        torch_env_from_slurm({k: v for k, v in TASK.items() if not k.endswith("NODELIST")})
    # through ccld run: one line, exit 2, nothing launched
    import os

    saved = dict(os.environ)
    try:
        os.environ.update({**TASK, "SLURM_NODEID": "7"})
        os.environ.pop("RANK", None)
        assert main(["run", "--", "python", "-c", "pass"]) == 2
    finally:
        os.environ.clear()
        os.environ.update(saved)
    err = capsys.readouterr().err.strip()
    assert err.startswith("ccld: error: SLURM_NODEID=7") and "\n" not in err
