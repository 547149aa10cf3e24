"""Public entry point of the Megatron integration: ``add_ccld_args`` (``--ccld``,
``--ccld-config``, ``--ccld-set``), ``install(args)`` after ``initialize_model_parallel``,
``mark_iteration``. The code lives in :mod:`ccld_plugin.integrations.megatron`."""

from ccld_plugin.integrations.megatron import (
    ArgsProvider,
    add_ccld_args,
    combine_providers,
    install,
    mark_iteration,
)

__all__ = ["ArgsProvider", "add_ccld_args", "combine_providers", "install", "mark_iteration"]
