"""Framework integrations: Megatron-core and DeepSpeed (plain PyTorch needs none: see
``ccld_plugin.workload``)."""
