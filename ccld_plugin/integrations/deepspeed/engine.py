"""DeepSpeed integration: a top-level ``"ccld"`` block in the DeepSpeed config turns it on.

Two ways in, both one line in the training script::

    engine, optimizer, _, _ = ccld_plugin.deepspeed.initialize(model=model, config=ds_config, ...)

or, after an existing ``deepspeed.initialize``::

    ccld_plugin.deepspeed.install(engine)

``initialize`` enables the plugin *before* ``deepspeed.initialize``, so the tracer sees
the collectives DeepSpeed issues while it builds the engine. ``install`` then registers
DeepSpeed's process groups with their roles and hooks the engine to mark steps. With no
``"ccld"`` block, or ``"enabled": false``, nothing is wrapped. The block is validated by
the plugin's schema (:func:`ccld_plugin.load_config`): a bad value raises
:class:`~ccld_plugin.ConfigError` at start, naming the key.

Group roles: :mod:`ccld_plugin.integrations.deepspeed.groups`.

Steps: step ``n`` (``engine.global_steps``) starts when the optimizer step that made
``global_steps == n`` returns; step 0 starts at the first forward. Gradient-accumulation
micro-steps call ``engine.step()`` too; only a call that advances ``global_steps`` starts a
step. Pipeline engines (``train_batch``) are not hooked yet.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.distributed.distributed_c10d as c10d

import ccld_plugin
from ccld_plugin.config import CcldConfig
from ccld_plugin.integrations.deepspeed.config import read_config
from ccld_plugin.integrations.deepspeed.groups import deepspeed_groups
from ccld_plugin.services.session import current

__all__ = ["EngineHooks", "building", "initialize", "install"]

_building: list[bool] = []  # [True] while initialize() runs deepspeed.initialize


def _rebind_backend_captures() -> int:
    """Point DeepSpeed's backend at the tracer's wrappers where it still holds originals.

    ``TorchBackend.__init__`` stores ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
    and then calls ``init_process_group``. When the plugin was enabled before that (the
    session starts inside ``init_process_group``), the tracer's install-time rebind runs
    before ``deepspeed.comm.comm.cdb`` is assigned and misses them. ZeRO's all-gathers and
    reduce-scatters would then be untraced on torch < 2.13, and on 2.13 seen only under the
    names of the calls inside them (``all_gather_single``, ``reduce_scatter_single``).
    The tracer's uninstall restores these attributes too.
    """
    cdb = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    if cdb is None or not hasattr(cdb, "__dict__"):
        return 0
    count = 0
    for key, value in list(vars(cdb).items()):
        name = getattr(value, "__name__", None)
        wrapper = getattr(c10d, name, None) if isinstance(name, str) else None
        if (
            wrapper is not None
            and wrapper is not value
            and getattr(wrapper, "__wrapped__", None) is value
        ):
            setattr(cdb, key, wrapper)
            count += 1
    return count


# ---------------------------------------------------------------------- hooks
class EngineHooks:
    """Marks steps from a DeepSpeed engine.

    Wraps ``engine.step`` (an instance attribute over the method) and adds a one-shot
    forward pre-hook on ``engine.module`` for step 0; the per-call cost is a counter
    compare in ``step``. Each function in ``step_callbacks`` is called with the step number
    at each step start, after the step is marked (the test harness's fault injector hangs
    itself there).
    """

    def __init__(self, engine: Any, mark_steps: bool = True) -> None:
        self.engine = engine
        self.mark_steps = mark_steps
        self.step_callbacks: list[Callable[[int], None]] = []
        self._started = False  # the current step's start has been marked
        self._handles: list[Any] = []
        self._patched: dict[str, Callable[..., Any]] = {}
        self.patch("step", self._wrap_step(engine.step))
        # Step 0 starts at the first forward: after checkpoint loading and data-loader set
        # up, which would otherwise be booked as step-0 time.
        self._first_forward = engine.module.register_forward_pre_hook(self._first_step)
        self._handles.append(self._first_forward)

    def patch(self, name: str, wrapper: Callable[..., Any]) -> None:
        """Set ``engine.<name>`` to ``wrapper`` until :meth:`remove`."""
        setattr(self.engine, name, wrapper)
        self._patched[name] = wrapper

    def add_handle(self, handle: Any) -> None:
        """A torch hook handle to remove with the others."""
        self._handles.append(handle)

    def remove(self) -> None:
        """Undo every wrap and hook (only those still in place, so later wraps survive)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for name, wrapper in self._patched.items():
            if vars(self.engine).get(name) is wrapper:
                delattr(self.engine, name)
        self._patched.clear()
        if getattr(self.engine, "_ccld_hooks", None) is self:
            del self.engine._ccld_hooks

    def _start_step(self) -> None:
        self._started = True
        step = int(self.engine.global_steps)
        if self.mark_steps:
            ccld_plugin.mark_step(step)
        for callback in self.step_callbacks:
            callback(step)

    def _wrap_step(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        engine = self.engine

        def step(*args: Any, **kwargs: Any) -> Any:
            before = engine.global_steps
            result = orig(*args, **kwargs)
            if engine.global_steps != before:  # an optimizer step, not a micro-step
                self._start_step()
            return result

        return step

    def _first_step(self, module: Any, inputs: Any) -> None:
        self._first_forward.remove()
        if not self._started:
            self._start_step()


# ---------------------------------------------------------------------- entry points
def install(
    engine: Any, overrides: Iterable[str] = (), config: CcldConfig | None = None
) -> EngineHooks | None:
    """Turn the plugin on for an engine built by ``deepspeed.initialize``.

    Reads the engine's ``"ccld"`` block (or uses ``config``), enables the plugin, registers
    the engine's groups with their roles and hooks its steps. Returns the hooks, or None
    when the block is missing or disabled (nothing is wrapped then). With no block but a
    plugin already enabled (by a launcher or ``ccld_plugin.enable``), the engine is hooked
    into that session. Installing twice returns the first hooks.
    """
    existing = getattr(engine, "_ccld_hooks", None)
    if existing is not None:
        return existing
    cfg = config if config is not None else read_config(engine, overrides)
    if cfg is not None and not cfg.enabled:
        return None
    if cfg is not None:
        ccld_plugin.enable(cfg)
    if current() is None:
        return None  # no block and no session, or the plugin could not start (logged)
    for group, role in deepspeed_groups(engine):
        ccld_plugin.register_group(group, role)
    _rebind_backend_captures()
    hooks = EngineHooks(engine)
    engine._ccld_hooks = hooks
    return hooks


def _bound_args(ds_initialize: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """``deepspeed.initialize``'s arguments by name, defaults included."""
    try:
        bound = inspect.signature(ds_initialize).bind_partial(*args, **kwargs)
    except TypeError:  # let deepspeed.initialize itself report the bad call
        return dict(kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _ds_config_arg(bound: Mapping[str, Any]) -> Any:
    """The DeepSpeed config that ``deepspeed.initialize`` will use (its own precedence)."""
    config = bound.get("config")
    if config is None:
        config = bound.get("config_params")
    if config is None:
        ns = bound.get("args")
        config = getattr(ns, "deepspeed_config", None) or getattr(ns, "deepscale_config", None)
    return config


def initialize(*args: Any, ccld_overrides: Iterable[str] = (), **kwargs: Any) -> Any:
    """``deepspeed.initialize`` with the plugin: same arguments, same return value.

    When the config has an enabled ``"ccld"`` block (``ccld_overrides`` merged into it),
    the plugin is enabled before DeepSpeed builds the engine, so nothing is missed, and
    :func:`install` hooks the engine after. A bad value stops here, before any collective.
    """
    import deepspeed

    bound = _bound_args(deepspeed.initialize, args, kwargs)
    cfg = read_config(_ds_config_arg(bound), ccld_overrides)
    enabled = cfg is not None and cfg.enabled
    if enabled:
        # deepspeed.initialize starts with exactly this call. Making it first means the
        # backend exists (with its captured collectives) when the tracer installs and
        # rebinds, so the engine's own set-up collectives are traced under their names.
        import deepspeed.comm as ds_comm
        from deepspeed.accelerator import get_accelerator
        from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

        ds_comm.init_distributed(
            dist_backend=get_accelerator().communication_backend_name(),
            distributed_port=bound.get("distributed_port", TORCH_DISTRIBUTED_DEFAULT_PORT),
            dist_init_required=bound.get("dist_init_required"),
        )
        ccld_plugin.enable(cfg)
    _building.append(True)
    try:
        result = deepspeed.initialize(*args, **kwargs)
    finally:
        _building.pop()
    if enabled:
        install(result[0], config=cfg)
    return result


def building() -> bool:
    """Whether :func:`initialize` is inside its call of ``deepspeed.initialize`` (which the
    start-up hook wraps with this very function: it then lets DeepSpeed's own run)."""
    return bool(_building)
