"""A DeepSpeed (ZeRO-2) training script that knows nothing of ccld (``ccld run`` turns it
on), for the ``deepspeed`` launcher, which passes ``--local_rank``.

FAULT as in ddp_plain.py: ``hang@R:S`` (rank R blocks at step S) or ``slow@R:X``."""

import argparse
import importlib
import os

import deepspeed
import torch
import torch.distributed as dist
from script_faults import fault

STEPS = int(os.environ.get("STEPS", "40"))
CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.parse_args()
    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory op at init that gloo training
    # does not use (minutes on a loaded 2-core machine): skipped, as examples/deepspeed does.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=CONFIG
    )
    torch.manual_seed(1 + rank)
    x, y = torch.randn(16, 256), torch.randn(16, 1)
    for step in range(STEPS):
        fault(rank, step)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
