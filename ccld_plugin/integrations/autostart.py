"""Turning the plugin on in an unchanged script (``ccld run``), at interpreter start.

``start`` reads the config that ``ccld run`` validated and put in the environment, and
enables the plugin, which waits for ``init_process_group``. Groups created later get
their role where the framework names it: DeviceMesh dimension names, Megatron's
parallel_state (after ``initialize_model_parallel``), DeepSpeed's groups (after
``deepspeed.initialize``). DDP's bucket all-reduces go through a comm hook that calls the
traced ``dist.all_reduce``. Steps are marked from a global optimizer step hook: step N+1
begins when the N-th optimizer step is done.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ccld_plugin.config import CcldConfig, load_config
from ccld_plugin.errors import report_error
from ccld_plugin.integrations.autoload import after_import

__all__ = ["CONFIG_ENV", "mesh_roles", "run_env", "start"]

CONFIG_ENV = "CCLD_RUN_CONFIG"  # the resolved config, as JSON

# DeviceMesh dimension names -> roles (lower case; the names torchtitan, FSDP2 and the
# PyTorch tutorials use).
_MESH_ROLES = {
    "tp": "tp",
    "tensor": "tp",
    "model": "tp",
    "pp": "pp",
    "pipe": "pp",
    "pipeline": "pp",
    "dp": "dp",
    "data": "dp",
    "ddp": "dp",
    "fsdp": "dp",
    "dp_shard": "dp",
    "shard": "dp",
    "dp_replicate": "dp",
    "replicate": "dp",
    "cp": "cp",
    "context": "cp",
    "dp_cp": "dp_cp",
    "dp_shard_cp": "dp_cp",
    "ep": "ep",
    "expert": "ep",
    "etp": "etp",
}
_REPLICATE = ("dp_replicate", "replicate")
_SHARD = ("dp_shard", "shard", "fsdp")


def mesh_roles(names: Sequence[str]) -> list[str]:
    """The role of each dimension of a mesh. With both a shard and a replicate dimension
    (HSDP) the shard one is "dp" (it carries the gradients' reduce-scatter) and the
    replicate one "other", so that a rank has one dp group to compare with its peers."""
    lower = [n.lower() for n in names]
    hsdp = any(n in _SHARD for n in lower) and any(n in _REPLICATE for n in lower)
    return ["other" if hsdp and n in _REPLICATE else _MESH_ROLES.get(n, "other") for n in lower]


def start() -> None:
    """Enable the plugin in this rank with the config ``ccld run`` passed."""
    cfg = load_config(json.loads(os.environ[CONFIG_ENV]))
    if not cfg.enabled:
        return
    import ccld_plugin

    ccld_plugin.enable(cfg)
    _watch_device_mesh()
    _trace_ddp_buckets()
    after_import("megatron.core.parallel_state", _watch_megatron)
    after_import("deepspeed", _watch_deepspeed)
    _mark_steps_from_optimizer()


def _register(pairs: Sequence[tuple[Any, str]]) -> None:
    from ccld_plugin.services.session import register_group

    for pg, role in pairs:
        register_group(pg, role)


def _watch_device_mesh() -> None:
    from torch.distributed import device_mesh

    cls = device_mesh.DeviceMesh
    init = cls.__init__

    @functools.wraps(init)
    def init_then_register(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not hasattr(self, "_dim_group_names"):
            # no groups of its own (torch >= 2.8): a mesh sliced from another (mesh["tp"],
            # which DTensor's parallelize_module makes), whose groups that one registered,
            # or one made with _init_backend=False
            return
        try:
            names = self.mesh_dim_names or ()
            _register([(self.get_group(i), r) for i, r in enumerate(mesh_roles(names))])
        except Exception as exc:  # noqa: BLE001 - a mesh without groups here, e.g. _init_backend=False
            report_error("autostart.device_mesh", exc)

    cls.__init__ = init_then_register  # type: ignore[method-assign]


class _BucketAllReduce:
    """DDP's bucket all-reduce as a comm hook: the reduction of DDP's own default, issued
    through the traced ``dist.all_reduce``.

    DDP waits on its buckets' futures in C++ at the end of backward (the reducer's
    finalize), where the tracer cannot count that wait as blocked time: a rank's peers
    would then look as busy computing as the straggler they wait for. So, for CPU
    tensors, the hook of the last bucket of a backward waits on all of the backward's
    buckets itself (through the traced work, which counts it): DDP issues buckets in
    index order, so every other one is in flight by then, and DDP would wait on them
    right after it anyway. On GPU, ``wait()`` only orders streams and blocks nothing, so
    the hook does not wait there.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        # DDP scales each gradient by 1/world as it copies it into a bucket when it has no
        # hook, and copies it unscaled when it has one: the same product, computed here.
        # (Where a gradient already is a view of its bucket, gradient_as_bucket_view with
        # gradients kept between steps, DDP divides by world instead: the same result
        # when the world is a power of two, possibly not in the last bit otherwise.)
        self.scale = 1.0 / group.size()
        self.in_flight: list[Any] = []

    def __call__(self, bucket: Any) -> Any:
        import torch.distributed as dist

        tensor = bucket.buffer()
        tensor.mul_(self.scale)
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        if not tensor.is_cuda:
            self.in_flight.append(work)
            if bucket.is_last():
                waits, self.in_flight = self.in_flight, []
                for w in waits:
                    w.wait()
        return work.get_future().then(_reduced_tensor)


def _reduced_tensor(fut: Any) -> Any:
    # A Python hook's future must hold a Python object: the one tensor all_reduce returns.
    return fut.value()[0]


def _bucket_hook(state, bucket):
    # DDP calls a comm hook as hook(state, bucket), and refuses one whose annotations are
    # not its own classes (these would be strings here, under `from __future__`).
    return state(bucket)


def _trace_ddp_buckets() -> None:
    """DDP all-reduces its gradient buckets from C++, past the traced Python API. Unless
    the script registers a comm hook of its own, register ``_BucketAllReduce`` at the first
    forward, before the first backward, as comm hooks must be."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    forward, register = DDP.forward, DDP.register_comm_hook
    hooked: set[int] = set()  # the DDP modules seen with a hook, theirs or ours

    @functools.wraps(register)
    def register_theirs(self: Any, *args: Any, **kwargs: Any) -> Any:
        hooked.add(id(self))
        return register(self, *args, **kwargs)

    @functools.wraps(forward)
    def forward_traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        if id(self) not in hooked:
            hooked.add(id(self))
            try:
                _register([(self.process_group, "dp")])  # DDP's group is data-parallel
                register(self, _BucketAllReduce(self.process_group), _bucket_hook)
            except Exception as exc:  # noqa: BLE001 - e.g. a builtin hook is registered
                report_error("autostart.ddp", exc)
        return forward(self, *args, **kwargs)

    DDP.register_comm_hook = register_theirs  # type: ignore[method-assign]
    DDP.forward = forward_traced  # type: ignore[method-assign]


def _watch_megatron(ps: Any) -> None:
    orig = ps.initialize_model_parallel

    @functools.wraps(orig)
    def init_then_register(*args: Any, **kwargs: Any) -> Any:
        result = orig(*args, **kwargs)
        try:
            from ccld_plugin.integrations.megatron.groups import parallel_state_groups

            _register(parallel_state_groups())
        except Exception as exc:  # noqa: BLE001
            report_error("autostart.megatron", exc)
        return result

    ps.initialize_model_parallel = init_then_register


def _watch_deepspeed(ds: Any) -> None:
    orig = ds.initialize

    @functools.wraps(orig)
    def init_then_register(*args: Any, **kwargs: Any) -> Any:
        result = orig(*args, **kwargs)
        try:
            from ccld_plugin.integrations.deepspeed.groups import deepspeed_groups

            _register(deepspeed_groups(result[0]))
        except Exception as exc:  # noqa: BLE001
            report_error("autostart.deepspeed", exc)
        return result

    ds.initialize = init_then_register


def _mark_steps_from_optimizer() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ccld_plugin.services.session import mark_step

    # Several optimizers step once each per training step: the first to step counts them.
    first: list[int] = []
    done = [0]

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not first:
            first.append(id(optimizer))
        if id(optimizer) == first[0]:
            done[0] += 1
            mark_step(done[0])

    register_optimizer_step_post_hook(hook)


def run_env(cfg: CcldConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment with the plugin on: our sitecustomize first on
    PYTHONPATH (ahead of any the job has, which it then runs) and the config."""
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autostart_site")
    path = [site, *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        **environ,
        "PYTHONPATH": os.pathsep.join(path),
        CONFIG_ENV: json.dumps(dataclasses.asdict(cfg)),
    }
