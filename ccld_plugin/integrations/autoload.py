"""What the start-up hook installed with the package (``_ccld_autoload``, imported at
interpreter start by ``ccld_autoload.pth``) does once a framework module is imported: the
plugin turned on by the framework's own way of being configured, with nothing added to the
script or the command line.

DeepSpeed (``deepspeed``): ``deepspeed.initialize`` becomes
:func:`ccld_plugin.integrations.deepspeed.engine.initialize` when the DeepSpeed config it is
given (a dict, a path, ``args.deepspeed_config``) has an enabled ``"ccld"`` block: the
plugin is enabled before the engine is built and the engine is hooked after. Without a
block, or with ``"enabled": false``, it is DeepSpeed's own call.

Megatron-LM (``megatron.training``): its argument parser gets ``--ccld``,
``--ccld-config`` and ``--ccld-set`` (``add_megatron_arguments``, which ``parse_args``
calls through the module at call time, so every caller gets them); after
``initialize_model_parallel`` (``megatron.core.parallel_state``, called as
``mpu.initialize_model_parallel``) the plugin is installed when the parsed arguments have
``--ccld``; and each ``train_step(..., iteration=N)`` marks step N.

``CCLD_AUTOLOAD=0`` keeps the hook from patching anything. The internals named here are
listed, with what each patch needs of them, in :mod:`ccld_plugin.integrations.internals`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import _ccld_autoload

from ccld_plugin.errors import report_error

__all__ = ["PATCHES", "after_import", "patch"]

# [session started] once --ccld installed the plugin in Megatron-LM
_megatron_lm: list[bool] = []


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once module ``name`` has executed (at once if it has),
    through the start-up hook's one finder."""
    _ccld_autoload.after_import(name, callback)


def _patch_deepspeed(ds: Any) -> None:
    original = ds.initialize

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        from ccld_plugin.integrations.deepspeed import engine
        from ccld_plugin.integrations.deepspeed.config import read_config

        if engine.building():  # ccld_plugin.deepspeed.initialize's own call
            return original(*args, **kwargs)
        # a bad block raises ConfigError here, before any engine: the job must not start
        cfg = read_config(engine._ds_config_arg(engine._bound_args(original, args, kwargs)))
        if cfg is None or not cfg.enabled:
            return original(*args, **kwargs)
        return engine.initialize(*args, **kwargs)

    ds.initialize = initialize


def _patch_megatron_arguments(arguments: Any) -> None:
    original = arguments.add_megatron_arguments

    @functools.wraps(original)
    def add_megatron_arguments(parser: Any) -> Any:
        parser = original(parser)
        try:
            from ccld_plugin.integrations.megatron.enable import add_ccld_args

            return add_ccld_args(parser)
        except Exception as exc:  # noqa: BLE001 - Megatron's own arguments still parse
            report_error("autoload.megatron_arguments", exc)
            return parser

    arguments.add_megatron_arguments = add_megatron_arguments


def _megatron_lm_args() -> Any:
    """Megatron-LM's parsed arguments (``get_args()``), or None before it parsed them or
    where Megatron-LM is not used (megatron-core alone)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def _patch_parallel_state(ps: Any) -> None:
    original = ps.initialize_model_parallel

    @functools.wraps(original)
    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        margs = _megatron_lm_args()
        if margs is not None and getattr(margs, "ccld", False) and not _megatron_lm:
            from ccld_plugin.integrations.megatron.enable import install

            # a bad --ccld-set raises ConfigError: the job must not run without it
            _megatron_lm.append(install(margs) is not None)
        return result

    ps.initialize_model_parallel = initialize_model_parallel


def _patch_training(training: Any) -> None:
    original = training.train_step

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        if _megatron_lm and _megatron_lm[0]:
            # train() passes it by name; the 8th parameter otherwise
            iteration = kwargs.get("iteration", args[7] if len(args) > 7 else None)
            if iteration is not None:
                try:
                    from ccld_plugin.services.session import mark_step

                    mark_step(int(iteration))
                except Exception as exc:  # noqa: BLE001 - training goes on unmarked
                    report_error("autoload.train_step", exc)
        return original(*args, **kwargs)

    training.train_step = train_step


# the modules' attributes are the frameworks': Any
PATCHES: dict[str, Callable[[Any], None]] = {
    "deepspeed": _patch_deepspeed,
    "megatron.core.parallel_state": _patch_parallel_state,
    "megatron.training.arguments": _patch_megatron_arguments,
    "megatron.training.training": _patch_training,
}


def patch(module: ModuleType) -> None:
    """Apply the plugin's patch to a watched module that has just executed."""
    PATCHES[module.__name__](module)
