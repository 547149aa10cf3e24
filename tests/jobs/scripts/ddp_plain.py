"""A plain DDP training script that knows nothing of ccld (``ccld run`` turns it on).

FAULT in the environment breaks one rank: ``hang@R:S`` (rank R blocks at step S),
``slow@R:X`` (rank R's compute takes X seconds more every step). At the end rank 0 prints
``params <sha256 of the parameters' bytes>``: the same with and without ccld."""

import hashlib
import os

import torch
import torch.distributed as dist
from script_faults import fault
from torch.nn.parallel import DistributedDataParallel

STEPS = int(os.environ.get("STEPS", "40"))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)  # each rank its own batch: the all-reduce averages them
    x, y = torch.randn(64, 256), torch.randn(64, 1)
    for step in range(STEPS):
        fault(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
        print(f"params {digest.hexdigest()}", flush=True)
    # DDP's reducer holds the group: without this, gloo aborts the process at exit about
    # one run in three ("terminate called without an active exception"), with or without ccld.
    del model, opt
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
