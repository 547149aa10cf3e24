"""DeepSpeed's process groups and the parallelism roles they play.

Group roles (DeepSpeed 0.19; every group is looked up, none is created):

=============  =========================================================================
dp             ``engine.data_parallel_group`` (the clone of the world group without mpu)
cp             ``engine.seq_parallel_group`` when ``sequence_parallel_size > 1``: Ulysses
               splits the sequence across ranks, which is what Megatron calls context
               parallelism (Megatron's "sequence parallel" lives inside TP)
dp_cp          ``engine.seq_data_parallel_group`` when it differs from the dp group: ZeRO
               shards and reduces gradients over DP x SP
dp / dp_cp     the groups ZeRO really uses: ``engine.optimizer.dp_process_group`` and
               ZeRO-3's ``param.ds_process_group`` (the world group by default; with SP,
               ZeRO-3 shards over all of DP x SP even on a DeepSpeed mesh), "dp_cp" when
               SP > 1. Groups with the same ranks share one board entry (the dp clone of
               the world group and the world group itself, for one)
ep             each group of ``engine.expert_parallel_group`` (MoE all-to-all)
other          each group of ``engine.expert_data_parallel_group``, and ZeRO++'s hpZ
               group (``groups._get_zero_param_intra_parallel_group()``)
tp, pp, mp     from an ``mpu`` when one is given (Megatron-DeepSpeed):
               tensor / pipeline / model parallel getters
=============  =========================================================================

Expert data parallel is "other", not "dp", for the reason given in
``ccld_plugin.integrations.megatron.groups``: with EP > 1 it spans other ranks than the
dense DP group, and a rank with two "dp" groups has no single cohort of DP peers. With
EP = 1 it has the same ranks as dense DP and shares its board entry anyway.
"""

from __future__ import annotations

from typing import Any

import torch.distributed.distributed_c10d as c10d

__all__ = ["deepspeed_groups"]


def deepspeed_groups(engine: Any) -> list[tuple[Any, str]]:
    """The engine's process groups this rank belongs to, as ``(group, role)`` pairs.

    Pure lookup after ``deepspeed.initialize`` (see the module docstring for the roles);
    a group object found twice is listed once, under its first role.
    """
    found: list[tuple[Any, str]] = []
    seen: set[int] = set()

    def add(group: Any, role: str) -> None:
        if group is None or group is c10d.GroupMember.NON_GROUP_MEMBER or id(group) in seen:
            return
        seen.add(id(group))
        found.append((group, role))

    sp = getattr(engine, "sequence_parallel_size", 1) or 1
    add(getattr(engine, "data_parallel_group", None), "dp")
    if sp > 1:
        add(getattr(engine, "seq_parallel_group", None), "cp")
        add(getattr(engine, "seq_data_parallel_group", None), "dp_cp")
    # The groups ZeRO really shards and reduces over: the optimizer's, and ZeRO-3's on each
    # parameter (the world group unless one was given). They span DP x SP when SP is on.
    zero_role = "dp_cp" if sp > 1 else "dp"
    add(getattr(getattr(engine, "optimizer", None), "dp_process_group", None), zero_role)
    module = getattr(engine, "module", None)
    param = (
        next((p for p in module.parameters() if hasattr(p, "ds_process_group")), None)
        if module is not None
        else None
    )
    add(getattr(param, "ds_process_group", None), zero_role)
    for group in (getattr(engine, "expert_parallel_group", None) or {}).values():
        add(group, "ep")
    for group in (getattr(engine, "expert_data_parallel_group", None) or {}).values():
        add(group, "other")
    mpu = getattr(engine, "mpu", None)
    for getter, role in (
        ("get_tensor_model_parallel_group", "tp"),
        ("get_pipeline_model_parallel_group", "pp"),
        ("get_pipe_parallel_group", "pp"),
        ("get_model_parallel_group", "mp"),
    ):
        fn = getattr(mpu, getter, None)
        if fn is not None:
            try:
                add(fn(), role)
            except (AssertionError, AttributeError, RuntimeError, TypeError):
                pass  # an mpu that does not build this group
    try:
        from deepspeed.utils import groups

        add(groups._get_zero_param_intra_parallel_group(), "other")
    except (ImportError, AttributeError):
        pass
    return found
