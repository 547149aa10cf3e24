"""Public entry point of the DeepSpeed integration: ``ccld_plugin.deepspeed.initialize``
(``deepspeed.initialize`` with the plugin) and ``ccld_plugin.deepspeed.install(engine)``.
The code lives in :mod:`ccld_plugin.integrations.deepspeed`."""

from ccld_plugin.integrations.deepspeed import (
    EngineHooks,
    ccld_block,
    deepspeed_groups,
    initialize,
    install,
    read_config,
)

__all__ = ["EngineHooks", "ccld_block", "deepspeed_groups", "initialize", "install", "read_config"]
