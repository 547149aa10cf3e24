"""Who and where of a verdict, as an operator acts on it: the job it belongs to, when it
was found (wall clock), a stable id, and where each rank it names runs (host, local rank,
device). Each rank publishes its own part (:func:`who_am_i`, through its agent); the
diagnoser reads it for the ranks its verdicts name (:class:`VerdictStamps`)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from ccld_plugin.control import ControlPlane
from ccld_plugin.diagnose import JobView, Verdict
from ccld_plugin.diagnose.records import Culprit, Device
from ccld_plugin.errors import report_error

__all__ = ["VerdictStamps", "launcher_job", "who_am_i"]

MAX_RANK = 2**31 - 1


def launcher_job(name: str) -> str:
    """The launcher's id of the job: ``SLURM_JOB_ID``, else ``TORCHELASTIC_RUN_ID``, else
    ``name`` (the job's name in the board paths)."""
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(var, "")
        if value and value != "none":  # torchrun's run id when none was given
            return value
    return name


def who_am_i() -> dict[str, Any]:
    """Where this rank runs: its local rank (``LOCAL_RANK``), the scheduler's name of its
    node (``SLURMD_NODENAME``, what ``srun --exclude`` takes), and the CUDA device it
    drives once CUDA is initialized here (never initialized for this: a CPU rank stays
    without one)."""
    torch: Any = sys.modules.get("torch")
    device = None
    if torch is not None and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        device = {"index": index, "uuid": _device_uuid(index)}
    local = os.environ.get("LOCAL_RANK", "")
    return {
        "local_rank": int(local) if local.isdigit() else None,
        "node": os.environ.get("SLURMD_NODENAME") or None,
        "device": device,
    }


@functools.cache
def _device_uuid(index: int) -> str | None:
    """The device's UUID as nvidia-smi and DCGM name it (``GPU-...``)."""
    torch: Any = sys.modules["torch"]
    try:
        return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    except Exception:  # noqa: BLE001 - an older torch, or a device that does not say
        return None


class VerdictStamps:
    """Stamps a diagnoser's verdicts with who and where (``Verdict.stamp``): ``job`` (the
    launcher's id), ``run`` (the job's start on its clock: the same for a standby that
    takes over, so a finding keeps its id), the time, and the culprits' hosts (from their
    summaries), local ranks and devices (from what they published)."""

    def __init__(self, control: ControlPlane, job: str | None, run: int) -> None:
        self.control = control
        self.job = job
        self.run = run
        self.who: dict[int, dict] = {}  # what the ranks named so far published

    def stamp(self, verdicts: Sequence[Verdict], view: JobView) -> None:
        ranks = sorted({r for v in verdicts for r in v.ranks})
        try:
            self.who.update(self.control.read_who(ranks))
        except Exception as exc:  # noqa: BLE001 - the verdicts go out without it
            report_error("diagnoser.who", exc)
        when = datetime.now(timezone.utc)
        for v in verdicts:
            v.stamp(self.job, self.run, when, lambda r: self._culprit(r, view))

    def node(self, culprit: Culprit) -> str | None:
        """The name a scheduler knows the culprit's host by: its Slurm node name where it
        published one, else its host name."""
        node = self.who.get(culprit.rank, {}).get("node")
        return node if isinstance(node, str) and node else culprit.host

    def _culprit(self, rank: int, view: JobView) -> Culprit:
        s = view.summaries.get(rank)
        who = self.who.get(rank, {})
        if not isinstance(who, dict):
            who = {}
        local, dev = who.get("local_rank"), who.get("device")
        device = None
        if isinstance(dev, dict) and _count(dev.get("index")):
            uuid = dev.get("uuid")
            device = Device(dev["index"], uuid if isinstance(uuid, str) else None)
        return Culprit(
            rank,
            host=s.host if s is not None and s.host else None,
            local_rank=local if _count(local) else None,
            device=device,
        )


def _count(x: Any) -> bool:
    return type(x) is int and 0 <= x <= MAX_RANK
