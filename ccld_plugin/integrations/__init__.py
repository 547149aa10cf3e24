"""Framework integrations: Megatron-core and DeepSpeed, each with its groups module, and
``autostart`` (``ccld run``: any script, unchanged). Plain PyTorch needs none:
``ccld_plugin.enable`` / ``register_group`` / ``mark_step``."""
