"""How many ranks a launcher command starts, read from its own arguments where it says:
``ccld run`` checks the ranks the config names against it before launching anything.

Read: ``torchrun`` and ``python -m torch.distributed.run`` / ``.launch`` (through torch's
own argument parser: ``--nproc-per-node`` times ``--nnodes``), and the ``deepspeed``
launcher (``--num_gpus`` times ``--num_nodes``, one node when it runs locally). Anything
else (plain ``python``, ``srun``, ``mpirun``, a per-node count of ``auto`` or ``gpu``) is
not known before the job starts; the ranks then check at start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LaunchWorld", "is_launcher", "launch_world"]

TORCH_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")
DEEPSPEED_RUNNER = "deepspeed.launcher.runner"
DEEPSPEED_HOSTFILE = "/job/hostfile"  # the deepspeed launcher's default hostfile


@dataclass(frozen=True)
class LaunchWorld:
    ranks: int
    """The fewest ranks the command may start the job with: a rank the config names must
    exist at every size the launcher may choose."""
    how: str
    """Where that number comes from, in the command's own words."""


def launch_world(cmd: Sequence[str]) -> LaunchWorld | None:
    """The ranks ``cmd`` starts with this process's environment (torchrun takes defaults
    from PET_* variables), or None when its arguments do not say (or do not parse: the
    launcher itself then says what is wrong with them)."""
    if not cmd:
        return None
    program = os.path.basename(cmd[0])
    if program == "torchrun":
        return _torchrun("torchrun", TORCH_LAUNCHERS[0], cmd[1:])
    if program == "deepspeed":
        return _deepspeed(cmd[1:])
    if program.startswith("python"):
        module, args = _python_module(cmd[1:])
        if module in TORCH_LAUNCHERS:
            return _torchrun(f"python -m {module}", module, args)
        if module == DEEPSPEED_RUNNER:
            return _deepspeed(args)
    return None


def is_launcher(cmd: Sequence[str]) -> bool:
    """Whether ``cmd`` is a launcher that starts the ranks and sets their variables itself
    (torchrun, ``python -m torch.distributed.run`` / ``.launch``, the deepspeed launcher)."""
    if not cmd:
        return False
    program = os.path.basename(cmd[0])
    if program in ("torchrun", "deepspeed"):
        return True
    return program.startswith("python") and _python_module(cmd[1:])[0] in (
        *TORCH_LAUNCHERS,
        DEEPSPEED_RUNNER,
    )


def _python_module(args: Sequence[str]) -> tuple[str | None, Sequence[str]]:
    """The module of ``python [options] -m MODULE ARGS...`` and its arguments."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            return (args[i + 1], args[i + 2 :]) if i + 1 < len(args) else (None, ())
        if arg.startswith("-m"):  # -mmodule
            return arg[2:], args[i + 1 :]
        if arg in ("-X", "-W", "--check-hash-based-pycs"):  # options with a value
            i += 2
            continue
        if not arg.startswith("-") or arg in ("-", "-c"):
            return None, ()  # a script, stdin or a command: not a launcher
        i += 1
    return None, ()


def _parsed(parser: argparse.ArgumentParser, args: Sequence[str]) -> argparse.Namespace | None:
    """``args`` as ``parser`` reads them, or None where it refuses them (quietly: the
    launcher prints its own usage error when it runs)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(list(args))
        except SystemExit:
            return None


def _torchrun(name: str, module: str, args: Sequence[str]) -> LaunchWorld | None:
    from torch.distributed import run  # here: only a torch launcher needs torch loaded

    parser = run.get_args_parser()
    if module == "torch.distributed.launch":
        parser.add_argument("--use-env", "--use_env", action="store_true")
    parsed = _parsed(parser, args)
    if parsed is None or not str(parsed.nproc_per_node).isdigit():
        return None  # auto, cpu, gpu: the machine decides
    try:
        low, high = run.parse_min_max_nnodes(str(parsed.nnodes))
    except (ValueError, RuntimeError):
        return None
    per_node = int(parsed.nproc_per_node)
    nodes = f"--nnodes {low}" if low == high else f"--nnodes {parsed.nnodes} at its fewest"
    return LaunchWorld(per_node * low, f"{name} --nproc-per-node {per_node} {nodes}")


def _deepspeed_parser() -> argparse.ArgumentParser:
    """The deepspeed launcher's options (deepspeed.launcher.runner; importing it would load
    deepspeed and probe the accelerator): the counts, and the others so that the script is
    found where it starts."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("-H", "--hostfile")
    p.add_argument("-i", "--include", default="")
    p.add_argument("-e", "--exclude", default="")
    p.add_argument("--num_nodes", type=int, default=-1)
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1)
    for value in (
        "--master_port",
        "--master_addr",
        "--node_rank",
        "--launcher",
        "--launcher_args",
        "--enable_each_rank_log",
        "--autotuning",
        "--bind_core_list",
        "--ssh_port",
        "--venv_script",
        "--log_level",
    ):
        p.add_argument(value)
    for flag in (
        "--module",
        "--no_python",
        "--no_local_rank",
        "--no_ssh",
        "--no_ssh_check",
        "--force_multi",
        "--save_pid",
        "--bind_cores_to_rank",
        "-q",
        "--quiet",
    ):
        p.add_argument(flag, action="store_true")
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def _deepspeed(args: Sequence[str]) -> LaunchWorld | None:
    parsed = _parsed(_deepspeed_parser(), args)
    if parsed is None or parsed.num_gpus <= 0 or parsed.include or parsed.exclude:
        return None
    hostfile = parsed.hostfile or DEEPSPEED_HOSTFILE
    if parsed.num_nodes > 0:
        nodes = parsed.num_nodes
    elif not os.path.isfile(hostfile):
        nodes = 1  # no hostfile: the launcher runs the job on this machine only
    else:
        return None  # every host of the hostfile
    how = f"deepspeed --num_gpus {parsed.num_gpus}" + (
        f" --num_nodes {nodes}" if parsed.num_nodes > 0 else " on this machine"
    )
    return LaunchWorld(parsed.num_gpus * nodes, how)
