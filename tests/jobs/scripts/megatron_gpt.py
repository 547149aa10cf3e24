"""examples/megatron/pretrain_gpt.py with two probes for the tests; same arguments.

- ``PROBE {...}`` at the start of the first iteration: whether torch.distributed's entry
  points and the references Megatron captured at import are the tracer's wrappers, and
  whether a plugin session is active;
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch.distributed.distributed_c10d as c10d

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "megatron" / "pretrain_gpt.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pretrain_gpt"] = module
    spec.loader.exec_module(module)
    return module


def _is_traced(fn: object) -> bool:
    # Tracer wrappers keep torch's name and doc but are defined in ccld_plugin.tracing.tracer.
    return getattr(fn, "__module__", "") == "ccld_plugin.tracing.tracer"


def _probe() -> dict:
    from megatron.core.distributed import param_and_grad_buffer as buffers
    from megatron.core.tensor_parallel import mappings

    from ccld_plugin.services.session import current

    names = (
        "all_reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "_coalescing_manager",
    )
    traced = {f"c10d.{n}": _is_traced(getattr(c10d, n)) for n in names}
    traced["dist.all_reduce"] = _is_traced(sys.modules["torch.distributed"].all_reduce)
    traced["param_and_grad_buffer.dist_reduce_scatter_func"] = _is_traced(
        buffers.dist_reduce_scatter_func
    )
    traced["param_and_grad_buffer.dist_all_gather_func"] = _is_traced(buffers.dist_all_gather_func)
    traced["param_and_grad_buffer._coalescing_manager"] = _is_traced(buffers._coalescing_manager)
    traced["mappings.dist_all_gather_func"] = _is_traced(mappings.dist_all_gather_func)
    return {"rank": c10d.get_rank(), "session": current() is not None, "traced": traced}


def main() -> None:
    example = _load_example()
    on_iteration = example.on_iteration

    def probing_on_iteration(iteration: int) -> None:
        on_iteration(iteration)
        if iteration == 0:
            print("PROBE " + json.dumps(_probe()), flush=True)

    example.on_iteration = probing_on_iteration  # train() looks the hook up at call time
    example.main()


if __name__ == "__main__":
    main()
