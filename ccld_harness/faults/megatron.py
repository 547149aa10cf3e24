"""Compute-fault injection in a Megatron job (tests, benchmarks and the demo).

``attach_faults()`` returns the rank's :class:`~ccld_harness.faults.Injector`
(faults from ``CCLD_FAULTS``), bound to Megatron's DP and TP groups, or None when no
compute fault targets this rank. The training loop calls
``injector.before_step(iteration)`` at each iteration start: a compute-hang blocks there,
a mismatch issues its odd collective there, and a compute-slow hooks into the tracer,
which then stretches the compute before every collective Megatron issues. No hook on the
model is needed, so it works with every schedule and layer spec; it needs the plugin on.
"""

from __future__ import annotations

import torch.distributed as dist

from ccld_harness.faults import Injector, injector_for

__all__ = ["attach_faults"]


def attach_faults() -> Injector | None:
    """The rank's fault injector; call after ``initialize_model_parallel`` (and after
    ``ccld_plugin.megatron.install``, so a compute-slow fault finds the tracer)."""
    injector = injector_for(dist.get_rank(), world=dist.get_world_size())
    if injector is None:
        return None
    from megatron.core import parallel_state as ps

    injector.bind_groups(
        {
            "dp": ps.get_data_parallel_group(),
            "tp": ps.get_tensor_model_parallel_group(),
        }
    )
    return injector
