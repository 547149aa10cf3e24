"""Framework integrations: Megatron-core and DeepSpeed, each with its groups module;
``autoload`` (what the start-up hook installed with the package patches: a DeepSpeed config
block, Megatron-LM's ``--ccld``); ``autostart`` (``ccld run``: any script, unchanged) with
``launch_world`` and ``slurm`` (a launcher's size, srun's variables); ``internals`` (the
frameworks' internals all of them rely on). Plain PyTorch needs none:
``ccld_plugin.enable`` / ``register_group`` / ``mark_step``."""
