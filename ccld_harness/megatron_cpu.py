"""Let megatron-core (0.16.x) train on a CPU-only machine with the gloo backend.

Megatron's forward, backward, pipeline schedules and optimizers call CUDA unconditionally.
``activate()`` patches just enough of ``torch.cuda`` and of Megatron's module objects that
tiny models train on CPU, for examples and integration tests. It is never active where CUDA
is available, and it can be called after ``import megatron.core``: it patches the module
objects found in ``sys.modules``, which is where Megatron looks names up at call time.

It is test infrastructure: every torch call in the process passes through one
``TorchFunctionMode`` while it is active, which costs a few microseconds per op.

``activate_megatron_lm()`` adds what Megatron-LM's own ``pretrain()`` (megatron/training)
needs on top, and injects the compute faults of ``CCLD_FAULTS`` at its iterations; the
``megatron_lm_site`` folder beside this module runs it at interpreter start in a rank.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["activate", "activate_megatron_lm", "is_active"]

_CPU = torch.device("cpu")
# Megatron's optimizers and grad clipping assert on these type strings.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"

_mode: TorchFunctionMode | None = None


def _is_cuda_device(device: Any) -> bool:
    # A bare int is "cuda:<int>" to torch.
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Turns CUDA placement in torch calls into CPU placement."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Float16Module, grad clipping and both optimizers accept only CUDA type strings.
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]  # already where it should be
        if func is torch.Tensor.record_stream:
            return None  # no streams on CPU
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU  # factories and .new_*() with device="cuda"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs an accelerator
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])  # t.to("cuda") / t.to(current_device())
        return func(*args, **kwargs)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # Megatron passes this as the device of new tensors. A CPU device rather than the
    # index 0 because autograd runs backward outside the mode below, where 0 means cuda:0.
    cuda.current_device = lambda: _CPU
    # The p2p code syncs after batched isend/irecv; CPU work is already done.
    cuda.synchronize = lambda device=None: None
    # The "CUDA" generator is the CPU default generator, so TP ranks still draw their own
    # dropout masks inside the RNG tracker's fork().
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))


def _patch_rng_tracker(random: ModuleType) -> None:
    # The tracker saves and restores the CUDA generator through these two helpers, which
    # index torch.cuda.default_generators; swap them for the CPU generator.
    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    random._get_cuda_rng_state = get_state
    random._set_cuda_rng_state = set_state
    # fork() warns when the CPU generator moves inside it; here that is the point of fork().
    logging.getLogger(random.__name__).addFilter(
        lambda record: _RNG_WARNING not in record.getMessage()
    )


def _patch_moe(moe_utils: ModuleType, dispatcher: ModuleType) -> None:
    # Without Transformer Engine 0.16.1 never defines te_general_gemm, yet the router tests
    # it for None; define it so the router falls back to torch matmul.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    cls = dispatcher.MoEAlltoAllTokenDispatcher
    # A non-None class attribute keeps __init__ from creating a torch.cuda.Stream.
    if cls.cuda_dtoh_stream is None:
        cls.cuda_dtoh_stream = object()

    def dtoh_on_cpu(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        # The GPU path copies the alltoall split sizes to the host as numpy arrays (which
        # all_to_all_single takes as int lists); maybe_move_tensor_to_cpu skips CPU tensors,
        # so convert them here, without the side stream and event the GPU path uses.
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    cls._maybe_dtoh_and_synchronize = dtoh_on_cpu


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def is_active() -> bool:
    """Whether ``activate()`` has patched this process."""
    return _mode is not None


def activate() -> bool:
    """Patch torch.cuda and megatron-core so that training runs on CPU.

    Returns False, touching nothing, when CUDA is available; otherwise patches once and
    returns True (also on later calls, which do nothing).
    """
    global _mode
    if _mode is not None:
        return True
    if torch.cuda.is_available():
        return False
    _patch_torch_cuda()
    # Megatron wraps small fusions in torch.compile at import; on CPU inductor would compile
    # C++ for each at first call (tens of seconds on 2 cores). Eager gives the same result.
    importlib.import_module("torch._dynamo").config.disable = True
    random = _import("megatron.core.tensor_parallel.random")
    if random is not None:
        _patch_rng_tracker(random)
    moe_utils = _import("megatron.core.transformer.moe.moe_utils")
    dispatcher = _import("megatron.core.transformer.moe.token_dispatcher")
    if moe_utils is not None and dispatcher is not None:
        _patch_moe(moe_utils, dispatcher)
    # Entered for good: the mode stays on this thread's torch-function stack, where forward,
    # the schedules and the optimizer run (autograd's backward runs without it).
    _mode = _CudaToCpuMode()
    _mode.__enter__()
    return True


class _Stream:
    """torch.cuda.Stream where CPU work is done when issued: every wait is over."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return _Event()

    def query(self) -> bool:
        return True


class _Event(_Stream):
    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


def _allow_no_cuda(initialize: ModuleType) -> None:
    # pretrain() asserts CUDA unless initialize_megatron gets allow_no_cuda; training.py
    # imports the function by name, after this module has run
    original = initialize.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron


def _inject_faults(training: ModuleType) -> None:
    """The rank's compute faults at iteration starts: inside the forward step function
    that ``train_step`` calls, so after the plugin's own wrapper marked the iteration."""
    original = training.train_step
    injector: list[Any] = []

    @functools.wraps(original)
    def train_step(forward_step_func, *args, **kwargs):
        if not injector:
            from ccld_harness.faults.megatron import attach_faults

            injector.append(attach_faults())
        iteration = kwargs.get("iteration")
        if injector[0] is None or iteration is None:
            return original(forward_step_func, *args, **kwargs)

        def forward_with_fault(*fargs, **fkwargs):
            injector[0].before_step(iteration)
            return forward_step_func(*fargs, **fkwargs)

        return original(forward_with_fault, *args, **kwargs)

    training.train_step = train_step


def activate_megatron_lm() -> bool:
    """``activate()``, and what Megatron-LM's ``pretrain()`` stops at on CPU, in the order
    it meets them: its CUDA assertion, the device properties its argument checks read
    with TP > 1, a device count of 0 (which skips ``initialize_model_parallel``), the
    dataset helpers it compiles with make (the wheel ships them built, without their
    Makefile), the fused kernels it builds with nvcc, and the CUDA streams of its DDP.
    Needs ``--transformer-impl local --no-persist-layer-norm
    --no-gradient-accumulation-fusion`` on its command line. False where CUDA is there."""
    if not activate():
        return False
    from ccld_plugin.integrations.autoload import after_import

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # validate_args asserts it
    cuda = torch.cuda
    cuda.get_device_properties = lambda device=None: SimpleNamespace(
        major=9, minor=0, name="cpu", total_memory=0, multi_processor_count=1
    )
    cuda.get_device_capability = lambda device=None: (9, 0)
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _Stream()
    cuda.default_stream = lambda device=None: _Stream()
    cuda.stream = lambda stream: contextlib.nullcontext()
    after_import("megatron.training.initialize", _allow_no_cuda)
    after_import(
        "megatron.core.datasets.utils", lambda m: setattr(m, "compile_helpers", lambda: None)
    )
    after_import("megatron.legacy.fused_kernels", lambda m: setattr(m, "load", lambda args: None))
    if os.environ.get("CCLD_FAULTS"):
        after_import("megatron.training.training", _inject_faults)
    return True
