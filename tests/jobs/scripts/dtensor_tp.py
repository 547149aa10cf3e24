"""Tensor parallelism with DTensor (parallelize_module: a colwise then a rowwise linear
layer) on a named 2-D DeviceMesh (dp x tp), gradients all-reduced over dp by hand; it
knows nothing of ccld. DTensor's collectives are functional ones (torch.ops._c10d_functional),
which reach the process group from C++.

FAULT as in script_faults.py: ``hang@R:S``, ``slow@R:X``, ``kill@R:S``, ``crash@R:S``."""

import os

import torch
import torch.distributed as dist
from script_faults import fault
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

STEPS = int(os.environ.get("STEPS", "40"))


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    )
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dp = mesh["dp"].get_group()
    torch.manual_seed(100 + mesh["dp"].get_local_rank())  # each DP replica its own data
    for step in range(STEPS):
        fault(rank, step)
        loss = model(torch.randn(64, 256)).square().mean()  # the rowwise layer all-reduces
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad.to_local(), group=dp)
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
