"""Inside the training thread: the tracer that wraps every torch.distributed collective and
P2P op (``tracer``), DTensor's functional collectives (``functional_ops``), the thread's
wait for a CPU (``cpu_wait``) and the NCCL profiler plugin's environment (``nccl_env``)."""
