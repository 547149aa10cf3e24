"""DeepSpeed: the ``"ccld"`` config block (config), the engine's groups and their roles
(groups), and the engine hooks that enable the plugin and mark steps (engine)."""

from ccld_plugin.integrations.deepspeed.config import ccld_block, read_config
from ccld_plugin.integrations.deepspeed.engine import EngineHooks, initialize, install
from ccld_plugin.integrations.deepspeed.groups import deepspeed_groups

__all__ = ["EngineHooks", "ccld_block", "deepspeed_groups", "initialize", "install", "read_config"]
