"""The demo's workload on the simulated device.

The layout and the communication of ``ccld_harness.workload`` (Megatron's rank order; per
block a TP all-reduce of its output forward and of its input gradient backward; PP
send/recv of activations and gradients per micro-batch, all forwards then all backwards;
a DP all-reduce of the gradients, async, waited for before the optimizer step), with
every computation a kernel on the device: a small MLP whose forward and backward are
written out, each matmul a kernel of ``kernel_ms``. The host only launches; it reads the
loss at one sync point per step, as ``loss.item()`` does on a GPU. At the end each rank
checks that its DP replicas hold the same weights (the collectives moved real data).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import ccld_plugin
from ccld_harness.simdev.backend import BACKEND, close_groups, register
from ccld_harness.simdev.device import SimClock, SimDevice
from ccld_harness.workload import Layout, WorkloadConfig, new_groups

__all__ = ["SimConfig", "run", "train"]


@dataclass
class SimConfig(WorkloadConfig):
    """The workload's, smaller: the device's time is its kernels' nominal time."""

    hidden: int = 32
    micro_batches: int = 2
    micro_batch_size: int = 16
    kernel_ms: float = 1.0  # a matmul kernel's nominal device time


@dataclass
class _Block:
    w1: torch.Tensor  # hidden x 4*hidden/tp (a column split)
    w2: torch.Tensor  # 4*hidden/tp x hidden (a row split)
    g1: torch.Tensor
    g2: torch.Tensor


@dataclass
class _Saved:
    x: torch.Tensor
    h: torch.Tensor


class _Stage:
    """This rank's blocks, their forward and backward as kernels and collectives."""

    def __init__(self, cfg: SimConfig, tp_group: Any, gen: torch.Generator) -> None:
        self.cfg, self.tp_group = cfg, tp_group
        self.device = SimDevice.get()
        width = 4 * cfg.hidden // cfg.tp
        self.blocks = []
        for _ in range(cfg.blocks_per_stage):
            w1 = torch.randn(cfg.hidden, width, generator=gen) / cfg.hidden**0.5
            w2 = torch.randn(width, cfg.hidden, generator=gen) / width**0.5
            self.blocks.append(_Block(w1, w2, torch.zeros_like(w1), torch.zeros_like(w2)))

    def kernel(self, fn: Any, share: float = 1.0) -> None:
        self.device.launch(fn, share * self.cfg.kernel_ms / 1000)

    def tp_all_reduce(self, t: torch.Tensor) -> None:
        if self.tp_group is not None:
            dist.all_reduce(t, group=self.tp_group)  # the current stream waits for it

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[_Saved]]:
        saved = []
        for b in self.blocks:
            h = torch.empty(x.shape[0], b.w1.shape[1])
            out = torch.empty_like(x)
            self.kernel(lambda x=x, h=h, b=b: torch.matmul(x, b.w1, out=h).relu_())
            self.kernel(lambda h=h, out=out, b=b: torch.matmul(h, b.w2, out=out))
            self.tp_all_reduce(out)
            y = torch.empty_like(x)
            self.kernel(lambda x=x, out=out, y=y: torch.add(x, out, out=y), 0.25)
            saved.append(_Saved(x, h))
            x = y
        return x, saved

    def backward(self, gy: torch.Tensor, saved: list[_Saved]) -> torch.Tensor:
        for b, s in zip(reversed(self.blocks), reversed(saved), strict=True):
            dh = torch.empty_like(s.h)
            dx = torch.empty_like(gy)

            def grads(b: _Block = b, s: _Saved = s, gy: torch.Tensor = gy, dh: Any = dh) -> None:
                b.g2.add_(s.h.T @ gy)
                torch.mul(gy @ b.w2.T, s.h > 0, out=dh)

            def inputs(b: _Block = b, s: _Saved = s, dh: Any = dh, dx: Any = dx) -> None:
                b.g1.add_(s.x.T @ dh)
                torch.matmul(dh, b.w1.T, out=dx)

            self.kernel(grads, 2.0)
            self.kernel(inputs, 2.0)
            self.tp_all_reduce(dx)
            gx = torch.empty_like(gy)
            self.kernel(lambda gy=gy, dx=dx, gx=gx: torch.add(gy, dx, out=gx), 0.25)
            gy = gx
        return gy

    def flat_grads(self) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for b in self.blocks for t in (b.g1, b.g2)])

    def weights(self) -> list[torch.Tensor]:
        return [t for b in self.blocks for t in (b.w1, b.w2)]


def train(cfg: SimConfig, injector: Any = None, timeout_s: float = 600.0) -> dict:
    """The training loop on an initialized ``sim`` process group; a small report."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout(world, cfg.tp, cfg.pp)
    t_idx, d_idx, stage = layout.coords(rank)
    groups = new_groups(layout, rank, timedelta(seconds=timeout_s))
    device = SimDevice.get()
    if injector is not None:
        injector.bind_groups(groups)
        injector.bind_device(device)
    weights_seed = torch.Generator().manual_seed(cfg.seed + stage * 1000 + t_idx)
    model = _Stage(cfg, groups.get("tp"), weights_seed)
    prev = layout.rank(t_idx, d_idx, stage - 1) if stage > 0 else None
    nxt = layout.rank(t_idx, d_idx, stage + 1) if stage < cfg.pp - 1 else None
    pp, dp = groups.get("pp"), groups.get("dp")
    gen = torch.Generator().manual_seed(cfg.seed + d_idx)
    shape = (cfg.micro_batch_size, cfg.hidden)
    losses: list[float] = []
    step_times: list[float] = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        ccld_plugin.mark_step(step)
        if injector is not None:
            injector.before_step(step)
        model.kernel(lambda: [t.zero_() for b in model.blocks for t in (b.g1, b.g2)], 0.25)
        loss = torch.zeros(())
        runs = []
        for _ in range(cfg.micro_batches):
            x = torch.randn(shape, generator=gen) if prev is None else torch.empty(shape)
            if prev is not None:
                dist.recv(x, prev, group=pp)
            y, saved = model.forward(x)
            if nxt is not None:
                dist.send(y, nxt, group=pp)
            else:
                model.kernel(lambda y=y, loss=loss: loss.add_(y.pow(2).mean()), 0.25)
            runs.append((y, saved))
        for y, saved in reversed(runs):
            gy = torch.empty(shape)
            if nxt is not None:
                dist.recv(gy, nxt, group=pp)
            else:
                model.kernel(lambda y=y, gy=gy: torch.mul(y, 2.0 / y.numel(), out=gy), 0.25)
            gx = model.backward(gy, saved)
            if prev is not None:
                dist.send(gx, prev, group=pp)
        _optimizer_step(model, dp, layout.dp, cfg.lr)
        device.compute.synchronize()  # the host reads the loss: a sync point
        if nxt is None:
            losses.append(float(loss) / cfg.micro_batches)
        step_times.append(time.perf_counter() - t0)
    return {
        "rank": rank,
        "steps": cfg.steps,
        "losses": losses,
        "step_times": step_times,
        "dp_replicas_agree": _replicas_agree(model, dp),
        "device_errors": device.errors,
    }


def _optimizer_step(model: _Stage, dp: Any, dp_size: int, lr: float) -> None:
    """The gradients all-reduced over DP (async, overlapped with nothing here but waited
    for on the device), then SGD."""
    flat = torch.empty(sum(t.numel() for t in model.weights()))
    model.kernel(lambda: flat.copy_(model.flat_grads()), 0.5)
    if dp is not None:
        dist.all_reduce(flat, group=dp, async_op=True).wait()  # the current stream waits

    def update() -> None:
        at = 0
        for w in model.weights():
            w.sub_(lr / dp_size * flat[at : at + w.numel()].view_as(w))
            at += w.numel()

    model.kernel(update, 0.5)


def _replicas_agree(model: _Stage, dp: Any) -> bool:
    """Whether every DP replica of this rank's shard holds the same weights."""
    if dp is None:
        return True
    mine = torch.stack([w.double().sum() for w in model.weights()])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(dp))]
    dist.all_gather(every, mine, group=dp)
    SimDevice.get().compute.synchronize()
    return all(torch.equal(e, every[0]) for e in every)


def run(args: argparse.Namespace) -> dict:
    """One rank of the workload on the simulated device (``workload --device sim``), from
    start to end; its report."""
    from ccld_harness.faults import injector_for

    # each rank's device counts from its own epoch, as GPUs' timers do
    rank = int(os.environ.get("RANK", "0"))
    SimDevice._instance = SimDevice(SimClock(offset_ns=(rank + 1) * 7_919_000_123_457))
    register()
    if not args.no_ccld:
        ccld_plugin.enable(overrides=args.ccld_set)
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=args.timeout_s))
    cfg = SimConfig(tp=args.tp, pp=args.pp, steps=args.steps, micro_batches=args.micro_batches)
    injector = injector_for(dist.get_rank(), world=dist.get_world_size())
    report = train(cfg, injector, args.timeout_s)
    # the run is only as good as its device: kernels that raised, or collectives that did
    # not move the data (DP replicas apart), fail the rank
    if report["device_errors"] or not report["dp_replicas_agree"]:
        raise RuntimeError(
            f"simulated device of rank {report['rank']}: kernel errors "
            f"{report['device_errors'][:3]}, DP replicas agree: {report['dp_replicas_agree']}"
        )
    dist.barrier()
    SimDevice.get().synchronize()
    ccld_plugin.disable()
    close_groups()
    dist.destroy_process_group()
    return report
