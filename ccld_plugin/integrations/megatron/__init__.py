"""Megatron-core: ``--ccld`` arguments and install (enable), parallel_state groups and
their roles (groups)."""

from ccld_plugin.integrations.megatron.enable import (
    ArgsProvider,
    add_ccld_args,
    combine_providers,
    install,
    mark_iteration,
)

__all__ = ["ArgsProvider", "add_ccld_args", "combine_providers", "install", "mark_iteration"]
