"""Pretrain a tiny GPT with megatron-core: tensor, pipeline, data and expert parallelism.

Runs under torchrun. On a machine without CUDA it uses gloo and the CPU compatibility
layer (``ccld_harness.megatron_cpu``); with CUDA it uses nccl and the layer stays off.

    torchrun --nproc-per-node 4 examples/megatron/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --train-iters 5

Add ``--ccld`` to turn on slow / hang diagnosis (``ccld_plugin.megatron``), configured
with ``--ccld-config PATH`` and repeatable ``--ccld-set KEY=VALUE``. Compute faults for
tests and demos come from ``CCLD_FAULTS`` (e.g. ``compute-slow@1:factor=3``), with or
without ``--ccld``.

The last pipeline stage prints one line per iteration:
``iteration 3/5 | loss 4.512345 | grad norm 1.234 | 812.3 ms``.
Pass ``--print-groups`` to also print, per rank, one JSON line of the parallel groups
(``groups {"rank": r, "groups": [[role, ranks], ...]}``); with ``--train-iters 0`` the
script only sets up the groups (the way to see context-parallel layouts, which the local
layer spec cannot train). MoE (``--num-experts``) trains with TP = 1 only: Megatron needs
sequence parallelism for MoE with TP, which the local spec lacks.
"""

# Megatron is imported below a warnings filter that has to run first.
# ruff: noqa: E402
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    # On CPU these import-time notices (no Transformer Engine / Apex, CUDA tuning hints) are
    # expected and repeat on every rank; keep the log to the training lines.
    for _message in (r".*not installed", r".*CUDA_DEVICE_MAX_CONNECTIONS", r"full scope is"):
        warnings.filterwarnings("ignore", message=_message, category=UserWarning)

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

from ccld_harness.faults.megatron import attach_faults
from ccld_plugin import ConfigError
from ccld_plugin import megatron as ccld

__all__ = ["main", "parse_args"]


# --------------------------------------------------------------------------------------
# Plugin hook points: the three calls that turn on slow / hang diagnosis (ccld_plugin).
# Without --ccld they do nothing and nothing is traced.
# --------------------------------------------------------------------------------------
def add_extra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Extra-args provider: --ccld, --ccld-config PATH, --ccld-set KEY=VALUE."""
    return ccld.add_ccld_args(parser)


def after_model_parallel_init(args: argparse.Namespace) -> None:
    """Called once on every rank, right after initialize_model_parallel."""
    ccld.install(args)  # registers every parallel_state group with its role


def on_iteration(iteration: int) -> None:
    """Called on every rank at the start of each iteration (0-based index)."""
    ccld.mark_iteration(iteration)


# --------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------
def parse_args(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    argv: list[str] | None = None,
) -> argparse.Namespace:
    """Parse the command line; ``extra_args_provider`` may add arguments, as in Megatron-LM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="for group layouts only: the local layer spec cannot train with CP > 1",
    )
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="default: the tensor-parallel size",
    )
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument(
        "--dist-timeout-s",
        type=float,
        default=600.0,
        help="timeout of every process group, in seconds",
    )
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--vocab-size", type=int, default=128)
    g.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="MoE experts per MLP layer (default: dense MLP)",
    )
    g.add_argument("--moe-router-topk", type=int, default=2)
    g = parser.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=5, help="0: set up the groups, build nothing")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="default: micro-batch-size * num-microbatches * data-parallel size",
    )
    g.add_argument(
        "--num-microbatches", type=int, default=4, help="used when --global-batch-size is not given"
    )
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--print-groups",
        action="store_true",
        help="print the parallel_state groups of every rank as JSON",
    )
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_args(argv)
    if args.num_experts is None and args.expert_model_parallel_size > 1:
        parser.error("--expert-model-parallel-size > 1 needs --num-experts")
    if args.num_experts is not None and args.tensor_model_parallel_size > 1:
        # Megatron requires sequence parallelism for MoE with TP, and the local (torch
        # LayerNorm) layer spec does not support sequence parallelism.
        parser.error("--num-experts needs --tensor-model-parallel-size 1 with the local spec")
    if args.context_parallel_size > 1 and args.train_iters > 0:
        # Megatron's local DotProductAttention asserts CP == 1 (CP needs Transformer Engine).
        parser.error("--context-parallel-size > 1 needs --train-iters 0 with the local spec")
    return args


# --------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------
def initialize_distributed(args: argparse.Namespace) -> None:
    """Start the default process group, then Megatron's parallel groups."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from ccld_harness import megatron_cpu

        megatron_cpu.activate()
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.dist_timeout_s)
    )
    world = dist.get_world_size()
    model_size = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    if world % model_size:
        raise ValueError(f"world size {world} is not divisible by TP*PP*CP = {model_size}")
    args.data_parallel_size = world // model_size
    if args.global_batch_size is None:
        args.num_microbatches_per_step = args.num_microbatches
    else:
        per_step = args.micro_batch_size * args.data_parallel_size
        if args.global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size {args.global_batch_size} is not divisible by "
                f"micro-batch-size * data-parallel size = {per_step}"
            )
        args.num_microbatches_per_step = args.global_batch_size // per_step

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        # Megatron takes minutes; a float is fine for its timedelta(minutes=...).
        distributed_timeout_minutes=args.dist_timeout_s / 60.0,
    )
    # Seeds the default and the tensor-/expert-parallel RNG streams (needs the groups).
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def build_model(args: argparse.Namespace) -> tuple[TransformerConfig, torch.nn.Module]:
    """A tiny GPTModel for this pipeline stage, wrapped in Megatron DDP."""
    moe = args.num_experts is not None
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=4 * args.hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        # Deterministic runs: no dropout, and no fused kernels (CUDA-only or torch.compile).
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=4 * args.hidden_size if moe else None,
        moe_router_topk=args.moe_router_topk if moe else 2,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2 if moe else 0.0,
    )
    layer_spec = get_gpt_layer_local_spec(num_experts=args.num_experts)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # Tied embeddings make the first and last stage all-reduce over the embedding group.
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    return config, model


def synthetic_batches(args: argparse.Namespace) -> Iterator[dict[str, torch.Tensor]]:
    """Deterministic micro-batches of arithmetic sequences ``(a + b*t) mod vocab``.

    The next token follows from the previous two, so the loss falls as the model learns.
    Every rank of one data-parallel replica draws the same batches; replicas differ.
    """
    gen = torch.Generator().manual_seed(args.seed * 1000 + parallel_state.get_data_parallel_rank())
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    positions = torch.arange(args.seq_length + 1)
    # True above the diagonal = masked: causal attention.
    causal = torch.ones(args.seq_length, args.seq_length, dtype=torch.bool).triu(1)
    while True:
        start = torch.randint(0, args.vocab_size, (args.micro_batch_size, 1), generator=gen)
        stride = torch.randint(1, 8, (args.micro_batch_size, 1), generator=gen)
        seq = (start + stride * positions) % args.vocab_size
        yield {
            "tokens": seq[:, :-1].to(device),
            "labels": seq[:, 1:].to(device),
            "loss_mask": torch.ones(args.micro_batch_size, args.seq_length, device=device),
            "position_ids": positions[:-1].expand(args.micro_batch_size, -1).to(device),
            "attention_mask": causal.view(1, 1, args.seq_length, args.seq_length).to(device),
        }


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses and the token count; the schedule divides one by the other."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    # Detached [sum, count] for reporting: summed over micro-batches and DP ranks later.
    report = torch.stack([loss_sum.detach(), mask.sum()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    """One micro-batch through this stage; the loss function is used on the last stage."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )
    return output, partial(loss_func, batch["loss_mask"])


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> list[float]:
    """Run ``--train-iters`` iterations; returns the losses (on the last stage only)."""
    if args.train_iters == 0:
        return []
    config, model = build_model(args)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=0.01,
            clip_grad=args.clip_grad,
            use_distributed_optimizer=args.use_distributed_optimizer,
            params_dtype=torch.float32,
        ),
        [model],
    )
    # What Megatron-LM's training loop sets so the schedule can sync and reduce grads.
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    # Test faults (CCLD_FAULTS); None on unaffected ranks.
    faults = attach_faults()
    forward_backward = get_forward_backward_func()
    data = synthetic_batches(args)
    is_last = parallel_state.is_pipeline_last_stage()
    reporter = (
        is_last
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    losses: list[float] = []
    for iteration in range(args.train_iters):
        on_iteration(iteration)  # HOOK: iteration boundary (step marker)
        if faults is not None:
            faults.before_step(iteration)  # a compute-hang blocks here
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[model],
            num_microbatches=args.num_microbatches_per_step,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        if is_last:
            total = torch.stack([r["lm loss"] for r in reduced]).sum(0)
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
            loss = (total[0] / total[1]).item()
            losses.append(loss)
            if reporter:
                ms = (time.perf_counter() - start) * 1e3
                norm = float("nan") if grad_norm is None else float(grad_norm)
                _emit(
                    f"iteration {iteration + 1}/{args.train_iters} | loss {loss:.6f} | "
                    f"grad norm {norm:.4f} | {ms:.1f} ms"
                )
    return losses


def print_groups() -> None:
    """One JSON line per rank: every parallel_state group with its role and global ranks."""
    from ccld_plugin.integrations.megatron.groups import parallel_state_groups

    groups = [
        [role, dist.get_process_group_ranks(group)] for group, role in parallel_state_groups()
    ]
    _emit("groups " + json.dumps({"rank": dist.get_rank(), "groups": groups}))


def _emit(line: str) -> None:
    # One write per line (print writes the newline apart), so that lines of ranks that
    # share a pipe do not interleave.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    """Set up the groups, train, and tear the groups down, also after an error."""
    args = parse_args(add_extra_args, argv)  # HOOK: extra-args provider
    try:
        initialize_distributed(args)
        after_model_parallel_init(args)  # HOOK: groups exist; register them with a plugin here
        if args.print_groups:
            print_groups()
        train(args)
    except ConfigError as exc:  # a bad --ccld-config / --ccld-set: one line, no traceback
        sys.exit(f"pretrain_gpt.py: error: {exc}")
    finally:
        if parallel_state.is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
