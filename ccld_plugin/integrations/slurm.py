"""torch.distributed's variables from Slurm's, for ``ccld run`` under ``srun`` with one task
per rank (``srun --ntasks-per-node=G ccld run -- python train.py``).

srun sets, in each task (srun(1), "OUTPUT ENVIRONMENT VARIABLES"): ``SLURM_PROCID`` (the
task's rank in the step), ``SLURM_LOCALID`` (its rank on its node), ``SLURM_NODEID`` (its
node's index in the step), ``SLURM_STEP_NUM_TASKS`` / ``SLURM_NTASKS`` (tasks in the step /
the job), ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (``2(x3),1``: 2 tasks on
each of 3 nodes, then 1), ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` (``gpu[01-04]``)
and ``SLURM_JOB_ID``. A step may use fewer nodes and tasks than its job: the step's
variables come first.

The mapping (never over a variable that is set: ``MASTER_ADDR`` and ``MASTER_PORT`` from an
sbatch script win)::

    RANK = SLURM_PROCID          WORLD_SIZE = SLURM_STEP_NUM_TASKS (else SLURM_NTASKS)
    LOCAL_RANK = SLURM_LOCALID   LOCAL_WORLD_SIZE = the tasks of this node (SLURM_NODEID)
    GROUP_RANK = SLURM_NODEID    MASTER_ADDR = the first node of the step's node list
    MASTER_PORT = 15000 + SLURM_JOB_ID % 10000 (as PyTorch Lightning picks it)

It applies only where ``RANK`` is absent and ``SLURM_PROCID`` present, and not to a
launcher (torchrun, the deepspeed launcher): under ``srun ... ccld run -- torchrun`` one
task per node runs torchrun, which sets each rank's variables itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["SlurmError", "expand_counts", "expand_hostlist", "torch_env_from_slurm"]

PORT_BASE = 15000

_HOST = re.compile(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)")  # prefix[ranges]suffix
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")  # 4 or 4(x2)
_INTEGER = re.compile(r"^\d+$")


class SlurmError(ValueError):
    """A Slurm variable that cannot be read; the message is one line naming it."""


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list, expanded: ``gpu[01-03,10],login7`` -> gpu01, gpu02,
    gpu03, gpu10, login7 (zero padding kept)."""
    hosts: list[str] = []
    pos = 0
    while pos < len(spec):
        m = _HOST.match(spec, pos)
        if m is None:
            raise SlurmError(f"host list {spec!r}: cannot read it at {spec[pos:]!r}")
        prefix, ranges, suffix = m.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
        else:
            for part in ranges.split(","):
                low, _, high = part.partition("-")
                if not _INTEGER.match(low) or (high and not _INTEGER.match(high)):
                    raise SlurmError(f"host list {spec!r}: {part!r} is not a number or range")
                width = len(low)
                for i in range(int(low), int(high or low) + 1):
                    hosts.append(f"{prefix}{i:0{width}d}{suffix}")
        pos = m.end()
        if pos < len(spec):
            if spec[pos] != ",":
                raise SlurmError(f"host list {spec!r}: expected ',' at {spec[pos:]!r}")
            pos += 1
    return hosts


def expand_counts(spec: str) -> list[int]:
    """Slurm's tasks per node, expanded: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = _COUNT.match(part.strip())
        if m is None:
            raise SlurmError(f"tasks per node {spec!r}: {part!r} is not N or N(xM)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _integer(environ: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set, as a number (None when none is set)."""
    for name in names:
        value = environ.get(name)
        if value is not None:
            if not _INTEGER.match(value.strip()):
                raise SlurmError(f"{name}={value!r} is not a number")
            return int(value)
    return None


def torch_env_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add for torch.distributed's ``env://`` (and the plugin) in an srun
    task; empty where ``RANK`` is set or ``SLURM_PROCID`` is not. Raises
    :class:`SlurmError` for a variable that cannot be read."""
    if "RANK" in environ or "SLURM_PROCID" not in environ:
        return {}
    rank = _integer(environ, "SLURM_PROCID")
    world = _integer(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if world is None:
        raise SlurmError("SLURM_PROCID is set but not SLURM_NTASKS: is this an srun task?")
    if rank >= world:  # type: ignore[operator]
        raise SlurmError(f"SLURM_PROCID={rank} is not below the step's {world} tasks")
    node = _integer(environ, "SLURM_NODEID") or 0
    local = _integer(environ, "SLURM_LOCALID") or 0
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    counts = expand_counts(per_node) if per_node else [world]
    if node >= len(counts):
        raise SlurmError(f"SLURM_NODEID={node} but the tasks per node {per_node!r} name fewer")
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(counts[node]),
        "GROUP_RANK": str(node),
    }
    if "MASTER_ADDR" not in environ:
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise SlurmError("no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: set MASTER_ADDR")
        env["MASTER_ADDR"] = expand_hostlist(nodes)[0]
    if "MASTER_PORT" not in environ:
        job = _integer(environ, "SLURM_JOB_ID")
        if job is None:
            raise SlurmError("no SLURM_JOB_ID to pick the store's port from: set MASTER_PORT")
        env["MASTER_PORT"] = str(PORT_BASE + job % 10000)
    return env
