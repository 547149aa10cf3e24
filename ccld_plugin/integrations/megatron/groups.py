"""Enumerate megatron-core's parallel_state process groups with their roles.

``parallel_state_groups()`` is pure lookup: it calls parallel_state getters after
``initialize_model_parallel`` and creates no group and issues no collective.

Role of each group (getter in ``megatron.core.parallel_state``, megatron-core 0.16):

=========  ==================================================================
tp         get_tensor_model_parallel_group(check_initialized=False)
pp         get_pipeline_model_parallel_group(check_initialized=False); a list
           of groups in layouts where a rank sits in several pipelines
dp         get_data_parallel_group(with_context_parallel=False)  (asserts if unbuilt)
dp_cp      get_data_parallel_group(with_context_parallel=True)   (asserts if unbuilt)
cp         get_context_parallel_group(check_initialized=False)
ep         get_expert_model_parallel_group(check_initialized=False)
etp        get_expert_tensor_parallel_group(check_initialized=False)
embd       get_embedding_group(check_initialized=False)
pos_embd   get_position_embedding_group(check_initialized=False)
mp         get_model_parallel_group (TP x PP: the ranks that hold one model replica)
other      get_tensor_and_data_parallel_group (TP x DP, and with CP),
           get_tensor_and_context_parallel_group (TP x CP),
           get_expert_data_parallel_group (expert DP; also its partial form),
           get_expert_tensor_and_model_parallel_group (ETP x EP),
           get_expert_tensor_model_pipeline_parallel_group (ETP x EP x PP),
           get_intra/inter_distributed_optimizer_instance_group,
           get_data_parallel_group_gloo / get_expert_data_parallel_group_gloo
           (gloo copies of the DP groups that the distributed optimizer uses)
=========  ==================================================================

Why expert-data-parallel and the gloo copies are "other", not "dp": with those rules every
named role has at most one group per rank (``pp`` aside), so a diagnosis can compare "the
dp group" of ranks directly. Expert DP spans different ranks than dense DP whenever EP > 1
and would make "dp" ambiguous; a gloo copy has the same ranks as its DP group but is a
separate communicator whose ops must not be matched with the other's.

Groups that are not built are skipped (getters return None or assert). A group object
returned by two getters is listed once, under the first role in the order above: e.g.
with CP = 1 and one distributed-optimizer instance, the partial DP group *is* the DP+CP
group. Separate objects with the same ranks (dp and dp_cp when CP = 1) are both listed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["ROLES", "parallel_state_groups"]

ROLES = ("tp", "pp", "dp", "ep", "etp", "cp", "dp_cp", "embd", "pos_embd", "mp", "world", "other")


def _getters(ps: Any) -> list[tuple[str, Callable[[], Any]]]:
    """(role, getter) in listing order; the lambdas defer each call into a try block."""
    return [
        ("tp", lambda: ps.get_tensor_model_parallel_group(check_initialized=False)),
        ("pp", lambda: ps.get_pipeline_model_parallel_group(check_initialized=False)),
        ("dp", lambda: ps.get_data_parallel_group(with_context_parallel=False)),
        ("dp_cp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        ("cp", lambda: ps.get_context_parallel_group(check_initialized=False)),
        ("ep", lambda: ps.get_expert_model_parallel_group(check_initialized=False)),
        ("etp", lambda: ps.get_expert_tensor_parallel_group(check_initialized=False)),
        ("embd", lambda: ps.get_embedding_group(check_initialized=False)),
        ("pos_embd", lambda: ps.get_position_embedding_group(check_initialized=False)),
        ("mp", lambda: ps.get_model_parallel_group(check_initialized=False)),
        ("other", lambda: ps.get_tensor_and_data_parallel_group(check_initialized=False)),
        (
            "other",
            lambda: ps.get_tensor_and_data_parallel_group(
                check_initialized=False, with_context_parallel=True
            ),
        ),
        ("other", lambda: ps.get_tensor_and_context_parallel_group(check_initialized=False)),
        ("other", lambda: ps.get_expert_data_parallel_group(check_initialized=False)),
        (
            "other",
            lambda: ps.get_expert_data_parallel_group(
                check_initialized=False, partial_expert_data_parallel=True
            ),
        ),
        (
            "other",
            lambda: ps.get_expert_tensor_and_model_parallel_group(check_initialized=False),
        ),
        (
            "other",
            lambda: ps.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False),
        ),
        (
            "other",
            lambda: ps.get_data_parallel_group(
                with_context_parallel=True, partial_data_parallel=True
            ),
        ),
        (
            "other",
            lambda: ps.get_intra_distributed_optimizer_instance_group(check_initialized=False),
        ),
        (
            "other",
            lambda: ps.get_inter_distributed_optimizer_instance_group(check_initialized=False),
        ),
        ("other", lambda: ps.get_data_parallel_group_gloo(with_context_parallel=False)),
        ("other", lambda: ps.get_data_parallel_group_gloo(with_context_parallel=True)),
        ("other", lambda: ps.get_expert_data_parallel_group_gloo()),
    ]


def parallel_state_groups() -> list[tuple[dist.ProcessGroup, str]]:
    """Every parallel_state group this rank belongs to, as ``(group, role)`` pairs.

    Call after ``parallel_state.initialize_model_parallel``; before it, returns ``[]``.
    Roles are from ``ROLES`` (this helper never uses "world"); see the module docstring.
    """
    from megatron.core import parallel_state as ps

    found: list[tuple[dist.ProcessGroup, str]] = []
    seen: set[int] = set()
    for role, getter in _getters(ps):
        try:
            value = getter()
        except (AssertionError, AttributeError, KeyError, RuntimeError, TypeError):
            # Unbuilt groups assert; getters missing or changed in other releases raise
            # AttributeError / TypeError. Either way there is no such group to list.
            continue
        for group in value if isinstance(value, list) else [value]:
            if group is None or id(group) in seen:
                continue
            seen.add(id(group))
            found.append((group, role))
    return found
