"""A DeepSpeed (ZeRO-2) training script that knows nothing of ccld: the DeepSpeed config it
is given (``--deepspeed_config``, DeepSpeed's own argument) has a ``"ccld"`` block, and the
start-up hook installed with the package does the rest. For torchrun and the deepspeed
launcher (which passes ``--local_rank``). FAULT as in script_faults.py."""

import argparse
import importlib
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from script_faults import fault

STEPS = int(os.environ.get("STEPS", "40"))


def main() -> None:
    p = argparse.ArgumentParser()
    # the deepspeed launcher passes it; torchrun sets LOCAL_RANK, which DeepSpeed checks
    # against it when args are given
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    args = deepspeed.add_config_arguments(p).parse_args()
    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory op at init that gloo training
    # does not use (minutes on a loaded 2-core machine): skipped, as examples/deepspeed does.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    rank = dist.get_rank()
    torch.manual_seed(1 + rank)
    x, y = torch.randn(16, 256), torch.randn(16, 1)
    for step in range(STEPS):
        fault(rank, step)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    print("result " + json.dumps({"rank": rank, "global_steps": engine.global_steps}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
