"""Compute-fault injection in a DeepSpeed job (tests, benchmarks and the demo).

``attach_faults(engine, hooks)`` gives the rank's :class:`~ccld_harness.faults.Injector`
(faults from ``CCLD_FAULTS``) the engine's groups and its step starts, or returns None when
no compute fault targets this rank. With the plugin on, ``hooks`` are the integration's
:class:`~ccld_plugin.integrations.deepspeed.EngineHooks`, and a compute-slow fault stretches
compute through the tracer. With the plugin off (``hooks`` None: a baseline run that must
see the same fault) there is no tracer, so each forward and ``engine.backward`` is timed
and stretched instead (wall time: ZeRO's collectives inside them are stretched too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ccld_harness.faults.inject import Injector, injector_for
from ccld_plugin.errors import report_error
from ccld_plugin.integrations.deepspeed import EngineHooks, deepspeed_groups
from ccld_plugin.tracing.cpu_wait import ThreadCpuWait

__all__ = ["attach_faults"]


def attach_faults(engine: Any, hooks: EngineHooks | None) -> Injector | None:
    injector = injector_for(dist.get_rank(), world=dist.get_world_size())
    if injector is None:
        return None
    by_role: dict[str, Any] = {}
    for group, role in deepspeed_groups(engine):
        by_role.setdefault(role, group)
    injector.bind_groups(by_role)
    if hooks is None:
        hooks = EngineHooks(engine, mark_steps=False)
        _time_compute(engine, hooks, injector.after_compute)
    hooks.step_callbacks.append(injector.before_step)  # a compute-hang blocks there
    return injector


def _time_compute(engine: Any, hooks: EngineHooks, stretch: Callable[[float], None]) -> None:
    def done(seconds: float) -> None:
        try:
            stretch(seconds)
        except Exception as exc:  # noqa: BLE001 - a fault hook must not end training
            report_error("deepspeed.after_compute", exc)

    queued = ThreadCpuWait()  # the training thread's: compute is without its wait for a CPU

    def now() -> float:
        return time.perf_counter() - queued.ns() / 1e9

    started = [0.0]

    def forward_started(module: Any, inputs: Any) -> None:
        started[0] = now()

    def forward_done(module: Any, inputs: Any, output: Any) -> None:
        done(max(0.0, now() - started[0]))

    backward = engine.backward

    def timed_backward(*args: Any, **kwargs: Any) -> Any:
        t0 = now()
        result = backward(*args, **kwargs)
        done(max(0.0, now() - t0))
        return result

    hooks.add_handle(engine.module.register_forward_pre_hook(forward_started))
    hooks.add_handle(engine.module.register_forward_hook(forward_done))
    hooks.patch("backward", timed_backward)
