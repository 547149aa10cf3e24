"""Put first on PYTHONPATH by the tests and benchmarks that run Megatron-LM's own
``pretrain_gpt.py`` on CPU, never by the product: in a training rank (RANK set by the
launcher) it turns on ``ccld_harness.megatron_cpu.activate_megatron_lm``."""

import os

if "RANK" in os.environ:
    from ccld_harness.megatron_cpu import activate_megatron_lm

    activate_megatron_lm()
