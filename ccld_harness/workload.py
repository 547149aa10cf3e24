"""A small plain-PyTorch training job with real TP, PP and DP communication.

This is the torchtitan-style integration (plain ``torch.distributed``, no framework) and
the workload of the demo and the tests. The model is a stack of MLP blocks:

- TP: each block's first linear is split by columns and its second by rows, so the forward
  all-reduces the block output over the TP group and the backward all-reduces the input
  gradient (Megatron's column/row parallel pattern);
- PP: blocks are split across stages; activations go forward and gradients backward with
  send/recv, micro-batch by micro-batch (all forwards, then all backwards);
- DP: gradients are all-reduced over the DP group in one flat bucket before the step.

Groups are laid out like Megatron's (TP fastest, then DP, then PP) and registered with
their roles. Run one process per rank with the usual env (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): ``python -m ccld_harness.workload --tp 2 --pp 2 --steps 20``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ccld_plugin

__all__ = ["Layout", "WorkloadConfig", "layout_groups", "main", "new_groups", "train"]


@dataclass(frozen=True)
class Layout:
    """Megatron-like rank layout: rank = t + tp * (d + dp * p)."""

    world: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world % (self.tp * self.pp) != 0:
            raise ValueError(
                f"world size {self.world} is not a multiple of tp={self.tp} x pp={self.pp}"
            )

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp index, dp index, pp stage) of a rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank(self, t: int, d: int, p: int) -> int:
        return t + self.tp * (d + self.dp * p)


def layout_groups(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group of each role, as lists of global ranks."""
    tp, dp, pp = layout.tp, layout.dp, layout.pp
    return {
        "tp": [[layout.rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[layout.rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[layout.rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


@dataclass
class WorkloadConfig:
    tp: int = 1
    pp: int = 1
    steps: int = 20
    hidden: int = 256
    blocks_per_stage: int = 2
    micro_batches: int = 4
    micro_batch_size: int = 64
    lr: float = 1e-3
    seed: int = 1234


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce in the forward, identity in the backward (row-parallel output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _CopyToTP(torch.autograd.Function):
    """Identity in the forward, all-reduce of the gradient in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Block(torch.nn.Module):
    def __init__(self, hidden: int, tp: int, tp_group: Any) -> None:
        super().__init__()
        self.tp_group = tp_group if tp > 1 else None
        self.up = torch.nn.Linear(hidden, 4 * hidden // tp)
        self.down = torch.nn.Linear(4 * hidden // tp, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _CopyToTP.apply(x, self.tp_group) if self.tp_group is not None else x
        out = self.down(torch.relu(self.up(h)))
        if self.tp_group is not None:
            out = _ReduceFromTP.apply(out, self.tp_group)
        return x + out


def new_groups(layout: Layout, rank: int, timeout: timedelta) -> dict[str, Any]:
    """Create every group on every rank (new_group is collective; of the default group's
    backend) and keep this rank's, registered with their roles."""
    mine: dict[str, Any] = {}
    for role, groups in layout_groups(layout).items():
        for ranks in groups:
            pg = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                mine[role] = pg
                if pg is not None:
                    ccld_plugin.register_group(pg, role)
    return mine


def _grad(t: torch.Tensor) -> torch.Tensor:
    """``t``'s gradient, which the backward pass before every use has set."""
    assert t.grad is not None
    return t.grad


def train(cfg: WorkloadConfig, injector: Any = None, timeout_s: float = 600.0) -> dict:
    """Run the training loop on an initialized process group; returns a small report."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout(world, cfg.tp, cfg.pp)
    t_idx, _, stage = layout.coords(rank)
    groups = new_groups(layout, rank, timedelta(seconds=timeout_s))
    if injector is not None:
        injector.bind_groups(groups)
    torch.manual_seed(cfg.seed + stage * 1000 + t_idx)
    blocks = torch.nn.Sequential(
        *[_Block(cfg.hidden, cfg.tp, groups.get("tp")) for _ in range(cfg.blocks_per_stage)]
    )
    params = [p for p in blocks.parameters()]
    optim = torch.optim.SGD(params, lr=cfg.lr)
    prev_rank = layout.rank(t_idx, layout.coords(rank)[1], stage - 1) if stage > 0 else None
    next_rank = (
        layout.rank(t_idx, layout.coords(rank)[1], stage + 1) if stage < cfg.pp - 1 else None
    )
    pp_group = groups.get("pp")
    gen = torch.Generator().manual_seed(cfg.seed + layout.coords(rank)[1])
    shape = (cfg.micro_batch_size, cfg.hidden)
    losses: list[float] = []
    step_times: list[float] = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        ccld_plugin.mark_step(step)
        if injector is not None:
            injector.before_step(step)
        optim.zero_grad(set_to_none=False)
        inputs, outputs, step_loss = [], [], 0.0
        for _ in range(cfg.micro_batches):
            if prev_rank is None:
                x = torch.randn(shape, generator=gen)
            else:
                x = torch.empty(shape)
                dist.recv(x, prev_rank, group=pp_group)
                x.requires_grad_(True)
            y = blocks(x)
            if next_rank is None:
                loss = y.pow(2).mean()
                step_loss += float(loss)
                y = loss
            else:
                dist.send(y.detach(), next_rank, group=pp_group)
            inputs.append(x)
            outputs.append(y)
        for x, y in zip(reversed(inputs), reversed(outputs), strict=True):
            if next_rank is None:
                y.backward()
            else:
                g = torch.empty(shape)
                dist.recv(g, next_rank, group=pp_group)
                y.backward(g)
            if prev_rank is not None:
                dist.send(_grad(x), prev_rank, group=pp_group)
        if groups.get("dp") is not None:
            flat = torch.cat([_grad(p).reshape(-1) for p in params])
            dist.all_reduce(flat, group=groups["dp"])
            flat /= layout.dp
            offset = 0
            for p in params:
                _grad(p).copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        optim.step()
        if next_rank is None:
            losses.append(step_loss / cfg.micro_batches)
        step_times.append(time.perf_counter() - t0)
    return {"rank": rank, "steps": cfg.steps, "losses": losses, "step_times": step_times}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="process-group timeout; keep it above the hang threshold",
    )
    p.add_argument("--no-ccld", action="store_true", help="run without the plugin")
    p.add_argument("--ccld-set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--report-dir", type=Path, help="write each rank's report here (JSON)")
    p.add_argument(
        "--device",
        choices=["cpu", "sim"],
        default="cpu",
        help="sim: the simulated device (ccld_harness.simdev), collectives asynchronous",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(
        level=os.environ.get("CCLD_LOG_LEVEL", "WARNING").upper(), format="%(message)s"
    )
    if args.device == "sim":
        from ccld_harness.simdev.training import run

        _write_report(args.report_dir, run(args))
        return 0
    if not args.no_ccld:
        ccld_plugin.enable(overrides=args.ccld_set)  # completes once the group exists
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    cfg = WorkloadConfig(
        tp=args.tp,
        pp=args.pp,
        steps=args.steps,
        hidden=args.hidden,
        micro_batches=args.micro_batches,
    )
    from ccld_harness.faults import injector_for

    report = train(cfg, injector_for(dist.get_rank(), world=dist.get_world_size()), args.timeout_s)
    _write_report(args.report_dir, report)
    dist.barrier()
    ccld_plugin.disable()
    dist.destroy_process_group()
    return 0


def _write_report(folder: Path | None, report: dict) -> None:
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Past this point torch's gloo can still abort the interpreter's native teardown
    # ("terminate called without an active exception", SIGABRT; one run in tens, with
    # ccld off too, the groups destroyed): the training is done and its report written,
    # so the exit handlers run and the process ends without that teardown, and the demo
    # does not call the job failed.
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
