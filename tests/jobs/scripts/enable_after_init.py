"""Turns the plugin on after the job's first collectives, as the integrations do (Megatron's
``install`` after ``initialize_model_parallel``, DeepSpeed's after its engine is built);
the arguments are config overrides. Prints ``step N`` after each step."""

import sys

import torch
import torch.distributed as dist

import ccld_plugin


def main() -> None:
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    ccld_plugin.enable(overrides=sys.argv[1:])
    for step in range(3):
        ccld_plugin.mark_step(step)
        dist.all_reduce(t)
        print(f"step {step}", flush=True)
    ccld_plugin.disable()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
