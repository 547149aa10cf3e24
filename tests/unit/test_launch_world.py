"""How many ranks a launcher command starts, as ``ccld run`` reads it before launching:
the launcher's own options only (the script's are its own), the fewest nodes of a range,
and nothing where the command does not say."""

from __future__ import annotations

import pytest

from ccld_plugin.config import CcldConfig, ConfigError, DiagnoserConfig, check_world
from ccld_plugin.integrations.launch_world import LaunchWorld, launch_world

TORCHRUN = ["python3", "-m", "torch.distributed.run"]


@pytest.mark.parametrize(
    "cmd, ranks, how",
    [
        (["torchrun", "--nproc-per-node", "2", "t.py", "--nproc-per-node", "9"], 2, "--nnodes 1"),
        ([*TORCHRUN, "--nproc_per_node=3", "--nnodes", "2", "t.py"], 6, "--nnodes 2"),
        ([*TORCHRUN, "--nproc-per-node", "2", "--nnodes", "1:4", "t.py"], 2, "1:4 at its fewest"),
        (
            [
                "/usr/bin/python",
                "-u",
                "-m",
                "torch.distributed.launch",
                "--use_env",
                "--nproc_per_node",
                "4",
                "t.py",
            ],
            4,
            "--nproc-per-node 4",
        ),  # fmt: skip
        (["deepspeed", "--num_gpus", "4", "t.py", "--num_gpus", "8"], 4, "on this machine"),
        (["deepspeed", "--num_gpus=2", "--num_nodes", "3", "t.py"], 6, "--num_nodes 3"),
    ],
)
def test_the_ranks_a_launcher_starts(cmd, ranks, how):
    world = launch_world(cmd)
    assert world is not None and world.ranks == ranks and how in world.how, world


@pytest.mark.parametrize(
    "cmd",
    [
        ["python", "train.py"],
        ["srun", "-n", "4", "python", "train.py"],
        ["torchrun", "--nproc-per-node", "auto", "t.py"],  # the machine decides
        ["torchrun", "--no-such-option", "t.py"],  # torchrun says what is wrong
        ["deepspeed", "t.py"],  # every GPU of every host of the hostfile
        ["deepspeed", "--num_gpus", "2", "--include", "h1", "t.py"],
        ["deepspeed", "--num_gpus", "2", "--hostfile", __file__, "t.py"],  # all its hosts
        ["python", "-c", "import torch.distributed.run"],
        [],
    ],
)
def test_commands_that_do_not_say_are_not_guessed(cmd):
    assert launch_world(cmd) is None


def test_a_rank_outside_the_world_is_one_line_that_names_the_launch():
    cfg = CcldConfig(diagnoser=DiagnoserConfig(rank=5))
    world = LaunchWorld(2, "torchrun --nproc-per-node 2 --nnodes 1")
    with pytest.raises(ConfigError) as info:
        check_world(cfg, world.ranks, world.how)
    assert str(info.value) == (
        "ccld config: diagnoser.rank=5 is not a rank of this job of 2 ranks (torchrun "
        "--nproc-per-node 2 --nnodes 1); expected 0..1, or -1 for a diagnoser process of its "
        "own (ccld diagnoser)"
    )
    check_world(cfg, 6)
    standby = CcldConfig(diagnoser=DiagnoserConfig(standby_rank=4))
    with pytest.raises(ConfigError, match=r"diagnoser.standby_rank=4 is not a rank .* 0\.\.3"):
        check_world(standby, 4)
    check_world(CcldConfig(diagnoser=DiagnoserConfig(standby_rank=4, standby=False)), 4)
