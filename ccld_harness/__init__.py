"""Launching and breaking jobs, for the tests, the benchmarks and ``ccld demo``: the demo
(``demo``; its options, ``options``; what a run should be diagnosed with and whether it was,
``outcome``; the host's room for ranks, ``capacity``; stop signals, ``stop_signals``), the
frameworks' training
(``frameworks``, ``workload``: a plain-PyTorch TP x PP x DP job, ``megatron_cpu``: Megatron
on gloo), local and network-namespace launchers (``launch``, ``netjob``) and the faults
(``faults``). The product (``ccld_plugin``) never imports it; only ``ccld demo`` does."""
