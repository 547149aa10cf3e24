"""What the product documents about itself, read from its code: the configuration's keys."""

from ccld_plugin.reference.config_keys import (
    ConfigKey,
    ConfigSection,
    config_keys,
    config_sections,
    explain,
)

__all__ = ["ConfigKey", "ConfigSection", "config_keys", "config_sections", "explain"]
