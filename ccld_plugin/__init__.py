"""ccld_plugin: real-time diagnosis of slow and hung ranks in distributed training.

The package is laid out like the data flow: ``tracing`` (inside the training thread)
writes the ``board``; the ``agent`` summarizes it, with its link ``probes``, into ``wire``
records sent over the ``control`` plane; ``diagnose`` turns them into verdicts for the
``sinks``. ``services`` start and wire them in a rank, ``postmortem`` reads what a job
left, ``integrations`` hook Megatron and DeepSpeed in. Launching and breaking jobs (the
tests, the demo) is ``ccld_harness``, a package beside this one.

Names here load lazily, so ``import ccld_plugin.diagnose`` (pure analysis) does not load
torch or the native module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ccld_plugin.config import CcldConfig, ConfigError, load_config
    from ccld_plugin.services.session import (
        disable,
        enable,
        mark_step,
        register_device,
        register_group,
    )
    from ccld_plugin.sinks.hooks import on_verdict

__all__ = [
    "__version__",
    "CcldConfig",
    "ConfigError",
    "disable",
    "enable",
    "load_config",
    "mark_step",
    "on_verdict",
    "register_device",
    "register_group",
]

_HOME = {
    "CcldConfig": "ccld_plugin.config",
    "ConfigError": "ccld_plugin.config",
    "load_config": "ccld_plugin.config",
    "disable": "ccld_plugin.services.session",
    "enable": "ccld_plugin.services.session",
    "mark_step": "ccld_plugin.services.session",
    "on_verdict": "ccld_plugin.sinks.hooks",
    "register_device": "ccld_plugin.services.session",
    "register_group": "ccld_plugin.services.session",
}


def _version() -> str:
    """The installed distribution's version: pyproject.toml is the one place it is written."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ccld-plugin")
    except PackageNotFoundError:  # a source tree on the path, never installed
        return "0+unknown"


__version__: str
# Type checkers see the imports above; at run time the names load on first use.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        if name == "__version__":
            globals()[name] = _version()
            return globals()[name]
        home = _HOME.get(name)
        if home is None:
            raise AttributeError(f"module 'ccld_plugin' has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*globals(), *__all__])
