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
``ccld_plugin.integrations.megatron_groups``: with EP > 1 it spans other ranks than the
dense DP group, and a rank with two "dp" groups has no single cohort of DP peers. With
EP = 1 it has the same ranks as dense DP and shares its board entry anyway.

Steps: step ``n`` (``engine.global_steps``) starts when the optimizer step that made
``global_steps == n`` returns; step 0 starts at the first forward. Gradient-accumulation
micro-steps call ``engine.step()`` too; only a call that advances ``global_steps`` starts a
step. Pipeline engines (``train_batch``) are not hooked yet.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import ccld_plugin
from ccld_plugin.config import CcldConfig, load_config
from ccld_plugin.errors import report_error
from ccld_plugin.session import current

__all__ = [
    "EngineHooks",
    "ccld_block",
    "deepspeed_groups",
    "initialize",
    "install",
    "read_config",
]

BLOCK_KEY = "ccld"


# ---------------------------------------------------------------------- config
def _load_ds_config(source: str | os.PathLike[str]) -> Mapping[str, Any]:
    """A DeepSpeed config file (JSON or hjson) or base64 string, read as DeepSpeed does."""
    try:
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    except ImportError:  # an older DeepSpeed: plain JSON files only
        return json.loads(Path(source).read_text())
    return load_ds_config(os.fspath(source))


def ccld_block(source: Any) -> Mapping[str, Any] | None:
    """The top-level ``"ccld"`` block of a DeepSpeed config, or None when it has none.

    ``source`` is a config dict, the path of a config file, or an engine (whose
    ``engine.config`` is the dict DeepSpeed parsed; ``engine._config._param_dict`` is the
    same dict, kept as a fallback).
    """
    if source is None:
        return None
    if isinstance(source, Mapping):
        cfg: Any = source
    elif isinstance(source, (str, os.PathLike)):
        cfg = _load_ds_config(source)
    else:
        cfg = getattr(source, "config", None)
        if not isinstance(cfg, Mapping):
            cfg = getattr(getattr(source, "_config", None), "_param_dict", None)
        if not isinstance(cfg, Mapping):
            return None
    block = cfg.get(BLOCK_KEY)
    if block is not None and not isinstance(block, Mapping):
        raise ccld_plugin.ConfigError(
            f"ccld config: the DeepSpeed config's {BLOCK_KEY!r} must be an object, "
            f"not {type(block).__name__}")
    return block


def read_config(source: Any, overrides: Iterable[str] = ()) -> CcldConfig | None:
    """The validated plugin config of a DeepSpeed config (see :func:`ccld_block`), with
    ``KEY=VALUE`` overrides merged into the block; None when there is no block. A bad key
    or value raises :class:`~ccld_plugin.ConfigError` even when the block is disabled."""
    block = ccld_block(source)
    if block is None:
        return None
    return load_config(dict(block), overrides)


# ---------------------------------------------------------------------- groups
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
    param = next((p for p in module.parameters() if hasattr(p, "ds_process_group")),
                 None) if module is not None else None
    add(getattr(param, "ds_process_group", None), zero_role)
    for group in (getattr(engine, "expert_parallel_group", None) or {}).values():
        add(group, "ep")
    for group in (getattr(engine, "expert_data_parallel_group", None) or {}).values():
        add(group, "other")
    mpu = getattr(engine, "mpu", None)
    for getter, role in (("get_tensor_model_parallel_group", "tp"),
                         ("get_pipeline_model_parallel_group", "pp"),
                         ("get_pipe_parallel_group", "pp"),
                         ("get_model_parallel_group", "mp")):
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
        if wrapper is not None and wrapper is not value and \
                getattr(wrapper, "__wrapped__", None) is value:
            setattr(cdb, key, wrapper)
            count += 1
    return count


# ---------------------------------------------------------------------- hooks
class EngineHooks:
    """Marks steps from a DeepSpeed engine and drives a fault injector from them.

    Wraps ``engine.step`` (an instance attribute over the method) and adds a one-shot
    forward pre-hook on ``engine.module`` for step 0; the per-call cost is a counter
    compare in ``step``. The injector's ``before_step`` runs at each step start: a
    compute-hang blocks there, and a compute-slow hooks itself into the tracer, which
    stretches the compute before every collective. With ``time_compute`` (for runs with
    the plugin off, where no tracer does that), each forward and ``engine.backward`` is
    timed instead and stretched with ``injector.after_compute`` (wall time: ZeRO's
    collectives inside them are stretched too).
    """

    def __init__(self, engine: Any, injector: Any = None, mark_steps: bool = True,
                 time_compute: bool = False) -> None:
        self.engine = engine
        self.injector = injector
        self.mark_steps = mark_steps
        self._started = False  # the current step's start has been marked
        self._t_forward = 0.0
        self._handles: list[Any] = []
        self._patched: dict[str, Callable[..., Any]] = {}
        self._patch("step", self._wrap_step(engine.step))
        # Step 0 starts at the first forward: after checkpoint loading and data-loader set
        # up, which would otherwise be booked as step-0 time.
        self._first_forward = engine.module.register_forward_pre_hook(self._first_step)
        self._handles.append(self._first_forward)
        if injector is not None and time_compute:
            module = engine.module
            self._handles.append(module.register_forward_pre_hook(self._forward_started))
            self._handles.append(module.register_forward_hook(self._forward_done))
            self._patch("backward", self._wrap_backward(engine.backward))

    def _patch(self, name: str, wrapper: Callable[..., Any]) -> None:
        setattr(self.engine, name, wrapper)
        self._patched[name] = wrapper

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
        if self.injector is not None:
            self.injector.before_step(step)  # a compute-hang blocks here, by design

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

    # Compute timing, only with time_compute.
    def _wrap_backward(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def backward(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            result = orig(*args, **kwargs)
            self._compute_done(time.perf_counter() - t0)
            return result

        return backward

    def _forward_started(self, module: Any, inputs: Any) -> None:
        self._t_forward = time.perf_counter()

    def _forward_done(self, module: Any, inputs: Any, output: Any) -> None:
        self._compute_done(time.perf_counter() - self._t_forward)

    def _compute_done(self, seconds: float) -> None:
        try:
            self.injector.after_compute(seconds)
        except Exception as exc:  # noqa: BLE001 - a fault hook must not end training
            report_error("deepspeed.after_compute", exc)


# ---------------------------------------------------------------------- entry points
def install(engine: Any, overrides: Iterable[str] = (),
            config: CcldConfig | None = None) -> EngineHooks | None:
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
    groups = deepspeed_groups(engine)
    for group, role in groups:
        ccld_plugin.register_group(group, role)
    _rebind_backend_captures()
    from ccld_plugin.faults import injector_for

    injector = injector_for(dist.get_rank(), world=dist.get_world_size())
    if injector is not None:
        by_role: dict[str, Any] = {}
        for group, role in groups:
            by_role.setdefault(role, group)
        injector.bind_groups(by_role)
    hooks = EngineHooks(engine, injector)
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
            dist_init_required=bound.get("dist_init_required"))
        ccld_plugin.enable(cfg)
    result = deepspeed.initialize(*args, **kwargs)
    if enabled:
        install(result[0], config=cfg)
    return result
