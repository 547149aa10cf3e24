"""A pipeline of one stage per rank with torch.distributed.pipelining (GPipe, four
micro-batches) on the world group: no group says which stage a rank is, and the stages
send each other activations and gradients. It knows nothing of ccld.

FAULT as in script_faults.py: ``hang@R:S``, ``slow@R:X[:S]``, ``kill@R:S``, ``crash@R:S``."""

import os

import torch
import torch.distributed as dist
from script_faults import fault
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

STEPS = int(os.environ.get("STEPS", "40"))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    layers = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU())
    stage = PipelineStage(layers, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.SGD(layers.parameters(), lr=1e-3)
    for step in range(STEPS):
        fault(rank, step)
        opt.zero_grad()
        x, target = torch.randn(32, 256), torch.randn(32, 256)
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=target, losses=[])
        else:
            schedule.step()
        opt.step()
        print(f"step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
