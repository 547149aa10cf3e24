"""Train a tiny MLP with DeepSpeed ZeRO on synthetic data, with slow / hang diagnosis.

Runs under torchrun or the deepspeed launcher, one process per rank. The plugin is turned
on by the ``"ccld"`` block of ``ds_config.json`` (``ccld_plugin.deepspeed.initialize``);
on a machine without CUDA, DeepSpeed runs on its CPU accelerator with gloo.

    torchrun --nproc-per-node 4 examples/deepspeed/train.py --zero-stage 3

Options: ``--zero-stage 1|2|3`` overrides the config's stage; repeatable
``--ccld-set KEY=VALUE`` merges into the ``"ccld"`` block (``enabled=false`` turns the
plugin off); ``--install late`` calls plain ``deepspeed.initialize`` and then
``ccld_plugin.deepspeed.install(engine)``; ``--moe`` adds a mixture-of-experts layer
(expert parallel size 2); ``--sp 2`` builds DeepSpeed's DP x SP mesh. Compute faults for
tests and demos come from ``CCLD_FAULTS`` (e.g. ``compute-slow@1:factor=3``), with or
without the plugin.

Rank 0 prints ``step 3/10 | loss 0.123456 | 45.6 ms`` per optimizer step; every rank ends
with one JSON line, ``result {"rank": r, "ccld": true, ...}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

import ccld_plugin
import ccld_plugin.deepspeed as ccld_ds
from ccld_harness.faults.deepspeed import attach_faults
from ccld_plugin import ConfigError

HERE = Path(__file__).resolve().parent
# DeepSpeed calls torch's all_gather_into_tensor, deprecated in torch 2.13: one notice per
# rank that the user cannot act on.
warnings.filterwarnings(
    "ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--deepspeed_config", "--deepspeed-config", type=Path, default=HERE / "ds_config.json"
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2, 3),
        help="override zero_optimization.stage of the config",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--moe", action="store_true", help="add an MoE layer, expert parallel 2")
    p.add_argument(
        "--sp",
        type=int,
        default=1,
        help="sequence_parallel_size: DeepSpeed builds a DP x SP mesh (the MLP "
        "does not split sequences; this shows the groups)",
    )
    p.add_argument(
        "--install",
        choices=("wrap", "late", "enable-first"),
        default="wrap",
        help="wrap: ccld_plugin.deepspeed.initialize; late: deepspeed.initialize "
        "then install(engine); enable-first: ccld_plugin.enable() before "
        "deepspeed.initialize, then install(engine), as a launcher would",
    )
    p.add_argument(
        "--ccld-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='merged into the config\'s "ccld" block',
    )
    p.add_argument(
        "--comms-logger-every",
        type=int,
        default=0,
        metavar="N",
        help="baseline: enable DeepSpeed's comms logger and print its straggler "
        "summary every N steps (every rank must call it: it barriers)",
    )
    p.add_argument(
        "--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher"
    )
    return p.parse_args(argv)


def skip_shm_op_on_cpu() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op (~25 s) at
    init; training on gloo does not use it. ``deepspeed.comm.torch`` as an attribute is
    shadowed by ``torch``, so patch the module object itself."""
    if get_accelerator().device_name() == "cpu":
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class TinyModel(torch.nn.Module):
    """Two residual MLP blocks, optionally with an MoE layer between them."""

    def __init__(self, hidden: int, moe: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(hidden, 4 * hidden),
                torch.nn.GELU(),
                torch.nn.Linear(4 * hidden, hidden),
            )
            for _ in range(2)
        )
        self.moe = None
        if moe:
            from deepspeed.moe.layer import MoE

            expert = torch.nn.Sequential(
                torch.nn.Linear(hidden, 2 * hidden),
                torch.nn.GELU(),
                torch.nn.Linear(2 * hidden, hidden),
            )
            self.moe = MoE(
                hidden, expert, num_experts=4, ep_size=2, k=1, min_capacity=4, drop_tokens=False
            )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        aux = x.new_zeros(())
        for i, block in enumerate(self.blocks):
            x = x + block(x)
            if i == 0 and self.moe is not None:
                out, aux, _ = self.moe(x)
                x = x + out
        return torch.nn.functional.mse_loss(x, y) + 0.01 * aux


def load_ds_config(args: argparse.Namespace) -> dict[str, Any]:
    config = json.loads(args.deepspeed_config.read_text())
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.comms_logger_every:
        config["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True}
    if args.sp > 1:
        config["sequence_parallel_size"] = args.sp
        config["data_parallel_size"] = int(os.environ.get("WORLD_SIZE", "1")) // args.sp
    return config


def model_parameters(model: torch.nn.Module) -> Any:
    if getattr(model, "moe", None) is None:
        return model.parameters()
    # ZeRO keeps expert parameters in their own groups (reduced over expert data parallel).
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"}
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    skip_shm_op_on_cpu()
    ds_config = load_ds_config(args)
    model = TinyModel(args.hidden, args.moe)
    init = dict(model=model, model_parameters=model_parameters(model), config=ds_config)
    try:
        if args.install == "wrap":
            engine, _, _, _ = ccld_ds.initialize(**init, ccld_overrides=args.ccld_set)
        else:
            if args.install == "enable-first":
                cfg = ccld_ds.read_config(ds_config, args.ccld_set)
                if cfg is not None and cfg.enabled:
                    ccld_plugin.enable(cfg)
            engine, _, _, _ = deepspeed.initialize(**init)
        # Idempotent: after ccld_ds.initialize it returns the hooks it made (None when off).
        hooks = ccld_ds.install(engine, overrides=args.ccld_set)
    except ConfigError as exc:
        print(exc, file=sys.stderr)  # one line that names the key and what is allowed
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()
    # Test faults from CCLD_FAULTS, with the plugin on or off (a baseline run sees the same
    # fault); None on unaffected ranks.
    attach_faults(engine, hooks)

    torch.manual_seed(1234 + rank)  # each rank its own data; the target map is shared
    target = torch.Generator().manual_seed(42)
    w_true = torch.randn(args.hidden, args.hidden, generator=target) / args.hidden**0.5
    batch = engine.train_micro_batch_size_per_gpu()
    dtype = next(p for p in engine.module.parameters()).dtype
    t_start = time.perf_counter()
    loss_value = float("nan")
    for step in range(args.steps):
        t0 = time.perf_counter()
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(batch, args.hidden)
            x, y = x.to(engine.device, dtype), (x @ w_true).to(engine.device, dtype)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        loss_value = float(loss.detach())
        if rank == 0:
            print(
                f"step {step + 1}/{args.steps} | loss {loss_value:.6f} | "
                f"{(time.perf_counter() - t0) * 1000:.1f} ms",
                flush=True,
            )
        if args.comms_logger_every and (step + 1) % args.comms_logger_every == 0:
            if rank == 0:
                print(
                    "COMMSLOG " + json.dumps({"step": step + 1, "wall_time": time.time()}),
                    flush=True,
                )
            deepspeed.comm.log_summary(show_straggler=True)
            sys.stdout.flush()
    result = {
        "rank": rank,
        "world": world,
        "steps": args.steps,
        "loss": loss_value,
        "zero_stage": engine.zero_optimization_stage(),
        "ccld": hooks is not None,
        "traced": dist.all_reduce.__module__ == "ccld_plugin.tracing.tracer",
        "seconds": round(time.perf_counter() - t_start, 3),
    }
    print("result " + json.dumps(result), flush=True)
    # The engine holds the groups: left to interpreter exit, gloo can abort a process
    # ("terminate called without an active exception", with ccld off too).
    del engine
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
