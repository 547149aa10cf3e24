"""A 2-D DeviceMesh (dp x tp, named dimensions) training step that knows nothing of ccld:
a tensor-parallel all-reduce of activations, a data-parallel all-reduce of gradients.

FAULT as in ddp_plain.py: ``hang@R:S`` or ``slow@R:X``; or ``skip@R:S``, ``crash@R:S``,
``kill@R:S``, ``misuse@R:S`` (script_faults)."""

import os

import torch
import torch.distributed as dist
from script_faults import fault, misuses, skips
from torch.distributed.device_mesh import init_device_mesh

STEPS = int(os.environ.get("STEPS", "40"))


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()
    rank = dist.get_rank()
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256, 256) / 16)
    opt = torch.optim.SGD([w], lr=0.01)
    x = torch.randn(64, 256)
    for step in range(STEPS):
        fault(rank, step)
        h = x @ w
        if misuses(rank, step):  # a gathered output sized for one member: raises here
            dist.all_gather_into_tensor(torch.empty_like(h), h, group=tp)
        dist.all_reduce(h, group=tp)  # the partial sums of a row-parallel layer
        loss = h.square().mean()
        opt.zero_grad()
        loss.backward()
        if not skips(rank, step):
            dist.all_reduce(w.grad, group=dp)
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
