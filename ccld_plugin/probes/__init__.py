"""The link probes beside the agent: this process's TCP sockets (``tcp_probe``: sock_diag
counters; ``tcp_peers``: which rank each connection leads to; ``tcp_wait``: what it waits
on) as per-peer channel entries (``tcp_channels``), and the NCCL profiler plugin's channel
records as the same entries (``nccl_channels``)."""
