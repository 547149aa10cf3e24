"""The frameworks' internals the integrations wrap, replace or read: the one list of what a
new release of torch, megatron-core, Megatron-LM or DeepSpeed can break.

Each entry names a module attribute (``Class.method`` for a method), what the plugin does
with it, and what it relies on: parameters by name (and, where a caller passes it by
position, its index), or an attribute a class sets on its instances. ``tests/unit/
test_framework_internals.py`` checks every entry against the installed frameworks, and
``python tools/internals_table.py`` writes the table in docs/integrations.md from it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["INTERNALS", "Internal"]


@dataclass(frozen=True)
class Internal:
    framework: str
    """torch, megatron-core, Megatron-LM or DeepSpeed"""
    module: str
    """where it lives"""
    name: str
    """the attribute in the module; ``Class.attr`` for one of a class"""
    use: str
    """what the plugin does with it: wraps, replaces, calls or reads"""
    params: tuple[str, ...] = ()
    """the parameters the plugin passes or reads by name"""
    position: int | None = None
    """the index of the last of ``params`` where callers pass it by position"""
    instance_attrs: tuple[str, ...] = ()
    """attributes the class's ``__init__`` sets that the plugin reads"""
    where: str = ""
    """the plugin's module that relies on it"""


_AUTOLOAD = "integrations/autoload.py"
_AUTOSTART = "integrations/autostart.py"
_DS_ENGINE = "integrations/deepspeed/engine.py"

INTERNALS: tuple[Internal, ...] = (
    # Megatron-LM (megatron/training, from its repository)
    Internal(
        "Megatron-LM",
        "megatron.training.arguments",
        "add_megatron_arguments",
        "wraps: adds --ccld, --ccld-config, --ccld-set to the parser it returns",
        ("parser",),
        where=_AUTOLOAD,
    ),
    Internal(
        "Megatron-LM",
        "megatron.training.arguments",
        "parse_args",
        "reads: it calls add_megatron_arguments through the module, so every caller gets "
        "the wrapped one",
        ("extra_args_provider", "ignore_unknown_args"),
        where=_AUTOLOAD,
    ),
    Internal(
        "Megatron-LM",
        "megatron.training.training",
        "train_step",
        "wraps: marks step N from its iteration argument",
        (
            "forward_step_func",
            "data_iterator",
            "model",
            "optimizer",
            "opt_param_scheduler",
            "config",
            "forward_backward_func",
            "iteration",
        ),
        position=7,
        where=_AUTOLOAD,
    ),
    Internal(
        "Megatron-LM",
        "megatron.training.global_vars",
        "_GLOBAL_ARGS",
        "reads: the parsed arguments (--ccld) after initialize_model_parallel",
        where=_AUTOLOAD,
    ),
    # megatron-core
    Internal(
        "megatron-core",
        "megatron.core.parallel_state",
        "initialize_model_parallel",
        "wraps: the groups exist after it; the plugin is installed (--ccld) or they are "
        "registered (ccld run)",
        ("tensor_model_parallel_size", "pipeline_model_parallel_size"),
        where=f"{_AUTOLOAD}, {_AUTOSTART}",
    ),
    Internal(
        "megatron-core",
        "megatron.core.parallel_state",
        "get_data_parallel_group",
        "calls: the dp and dp_cp groups (the other getters are public)",
        ("with_context_parallel", "partial_data_parallel"),
        where="integrations/megatron/groups.py",
    ),
    # DeepSpeed
    Internal(
        "DeepSpeed",
        "deepspeed",
        "initialize",
        "wraps: an enabled 'ccld' block in the config it is given enables the plugin "
        "before the engine is built; reads the config with DeepSpeed's precedence",
        ("args", "model", "distributed_port", "dist_init_required", "config", "config_params"),
        where=f"{_AUTOLOAD}, {_DS_ENGINE}, {_AUTOSTART}",
    ),
    Internal(
        "DeepSpeed",
        "deepspeed.comm",
        "init_distributed",
        "calls: before the plugin is enabled, as deepspeed.initialize does first",
        ("dist_backend", "distributed_port", "dist_init_required"),
        where=_DS_ENGINE,
    ),
    Internal(
        "DeepSpeed",
        "deepspeed.runtime.tensor_parallel.init_utils",
        "load_ds_config",
        "calls: a config path or base64 string read as DeepSpeed reads it",
        ("config",),
        where="integrations/deepspeed/config.py",
    ),
    Internal(
        "DeepSpeed",
        "deepspeed.runtime.engine",
        "DeepSpeedEngine.step",
        "wraps (per engine): a step starts when global_steps advances; reads the engine's "
        "config and groups",
        instance_attrs=("global_steps", "config", "_config", "data_parallel_group"),
        where=_DS_ENGINE,
    ),
    Internal(
        "DeepSpeed",
        "deepspeed.comm.comm",
        "cdb",
        "reads: the backend's captured all_gather_into_tensor / reduce_scatter_tensor, "
        "pointed at the tracer's",
        where=_DS_ENGINE,
    ),
    Internal(
        "DeepSpeed",
        "deepspeed.utils.groups",
        "_get_zero_param_intra_parallel_group",
        "calls: ZeRO++'s hpZ group, registered as 'other'",
        where="integrations/deepspeed/groups.py",
    ),
    # torch (what ccld run hooks beyond the traced torch.distributed functions)
    Internal(
        "torch",
        "torch.distributed.device_mesh",
        "DeviceMesh.__init__",
        "wraps: registers each dimension's group with the role its name gives",
        instance_attrs=("_dim_group_names", "mesh_dim_names"),
        where=_AUTOSTART,
    ),
    Internal(
        "torch",
        "torch.nn.parallel",
        "DistributedDataParallel.forward",
        "wraps: registers a comm hook that issues the bucket all-reduce through the tracer",
        where=_AUTOSTART,
    ),
    Internal(
        "torch",
        "torch.nn.parallel",
        "DistributedDataParallel.register_comm_hook",
        "wraps: a script's own hook is left in place",
        ("state", "hook"),
        where=_AUTOSTART,
    ),
    Internal(
        "torch",
        "torch.optim.optimizer",
        "register_optimizer_step_post_hook",
        "calls: steps marked from the first optimizer to step",
        ("hook",),
        where=_AUTOSTART,
    ),
)
