"""Compatibility layers that let third-party training stacks run where they normally cannot.

They are test and example infrastructure, kept apart from the plugin's own code: nothing in
``ccld_plugin`` imports them. ``megatron_cpu`` runs megatron-core on CPU with gloo.
"""

__all__: list[str] = []
