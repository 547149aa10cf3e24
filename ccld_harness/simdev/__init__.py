"""The simulated device: streams, events and a c10d backend with CUDA's ordering, on CPU."""
