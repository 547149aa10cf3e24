"""A data-parallel loop whose ``main`` catches any error, reports it and exits with code 1,
as many training scripts do: a rank's failure ends every process by ``sys.exit(1)``, which
Python runs as cleanly as a finished job. FAULT as in script_faults (``crash@R:S``: rank R
raises at step S; here it is caught)."""

import os
import sys

import torch
import torch.distributed as dist
from script_faults import fault

STEPS = int(os.environ.get("STEPS", "40"))


def train(rank: int) -> None:
    torch.manual_seed(rank)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    for step in range(STEPS):
        fault(rank, step)
        model(x).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        train(rank)
    except Exception as exc:  # noqa: BLE001 - the script's own report, then exit 1
        print(f"rank {rank}: training failed: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
