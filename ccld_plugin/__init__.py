"""ccld_plugin: real-time diagnosis of slow and hung ranks in distributed training."""

from ccld_plugin.config import CcldConfig, ConfigError, load_config
from ccld_plugin.session import disable, enable, mark_step, register_group

__all__ = [
    "CcldConfig",
    "ConfigError",
    "disable",
    "enable",
    "load_config",
    "mark_step",
    "register_group",
]
