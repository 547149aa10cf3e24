"""Megatron integration: ``--ccld`` on the command line, parallel_state groups, iterations.

Three calls in a Megatron training script::

    from ccld_plugin import megatron as ccld

    args = parse_args(extra_args_provider=ccld.add_ccld_args)   # --ccld, --ccld-config, ...
    initialize_model_parallel(...)
    ccld.install(args)                 # no-op without --ccld
    for iteration in ...:
        ccld.mark_iteration(iteration)

With a provider of your own, chain them: ``extra_args_provider=combine_providers(mine,
ccld.add_ccld_args)``. ``install`` may run long after ``import megatron.core``: the tracer
rebinds the collectives that Megatron captured at import, so nothing has to be
installed early.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import ccld_plugin
from ccld_plugin.config import load_config
from ccld_plugin.errors import log, report_error
from ccld_plugin.services.session import Session

__all__ = ["ArgsProvider", "add_ccld_args", "combine_providers", "install", "mark_iteration"]

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def add_ccld_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--ccld``, ``--ccld-config PATH`` and ``--ccld-set KEY=VALUE`` (repeatable).

    Returns the parser, as Megatron's ``extra_args_provider`` contract requires. A parser
    that has ``--ccld`` already (Megatron-LM's, given it by the start-up hook) is returned
    as it is, so scripts that pass this provider too keep working.
    """
    if "--ccld" in parser._option_string_actions:
        return parser
    g = parser.add_argument_group("ccld", "slow / hang diagnosis (ccld_plugin)")
    g.add_argument(
        "--ccld", action="store_true", help="trace collectives and diagnose slow and hung ranks"
    )
    g.add_argument(
        "--ccld-config",
        metavar="PATH",
        default=None,
        help="YAML config of the plugin (default: built-in defaults)",
    )
    g.add_argument(
        "--ccld-set",
        metavar="KEY=VALUE",
        action="append",
        default=None,
        help="override one config key, e.g. board.dir=/tmp/boards (repeatable)",
    )
    return parser


def combine_providers(*providers: ArgsProvider | None) -> ArgsProvider:
    """One ``extra_args_provider`` that applies ``providers`` in order (None entries skipped)."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser

    return provider


def install(args: argparse.Namespace) -> Session | None:
    """Turn the plugin on if ``args.ccld`` is set; call after ``initialize_model_parallel``.

    Enables tracing with the config from ``--ccld-config`` and ``--ccld-set``, then registers
    every parallel_state group with its role (tp, pp, dp, dp_cp, cp, ep, etp, embd,
    pos_embd, mp, other). Returns the session, or None when ``--ccld`` is absent (nothing
    is wrapped then) or the config disables the plugin. A bad config key or value raises
    :class:`ccld_plugin.ConfigError` with a one-line message; any other failure inside the
    plugin is contained and training runs untraced.
    """
    config_path = getattr(args, "ccld_config", None)
    overrides = list(getattr(args, "ccld_set", None) or ())
    if not getattr(args, "ccld", False):
        if config_path or overrides:
            log.warning("ccld: --ccld-config / --ccld-set given without --ccld; plugin is off")
        return None
    cfg = load_config(config_path, overrides)  # ConfigError must stop the job: not contained
    session = ccld_plugin.enable(cfg)
    if session is None:
        return None
    try:
        from ccld_plugin.integrations.megatron.groups import parallel_state_groups

        groups = parallel_state_groups()
        if not groups:
            log.warning(
                "ccld: no parallel_state groups yet; call install(args) after "
                "initialize_model_parallel to get tp/pp/dp roles"
            )
        for group, role in groups:
            ccld_plugin.register_group(group, role)
    except Exception as exc:  # noqa: BLE001 - roles are a refinement; tracing goes on
        report_error("megatron.install", exc)
    return session


def mark_iteration(iteration: int) -> None:
    """Mark the start of training iteration ``iteration`` (a no-op when the plugin is off)."""
    ccld_plugin.mark_step(iteration)
