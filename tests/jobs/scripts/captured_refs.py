"""A module that captures collectives at import, like Megatron's mappings.py and
param_and_grad_buffer.py do, before the plugin is installed."""

from torch.distributed import all_gather_into_tensor, reduce_scatter_tensor

dist_all_gather_func = all_gather_into_tensor


def gather(out, inp, group=None):
    return dist_all_gather_func(out, inp, group=group)


def scatter(out, inp, group=None):
    return reduce_scatter_tensor(out, inp, group=group)
