"""The ``"ccld"`` block of a DeepSpeed config: where it is read from, and its validation by
the plugin's own schema (:func:`ccld_plugin.load_config`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ccld_plugin.config import CcldConfig, ConfigError, load_config
from ccld_plugin.config_values import problem, shown

__all__ = ["BLOCK_KEY", "ccld_block", "read_config"]

BLOCK_KEY = "ccld"


def _load_ds_config(source: str | os.PathLike[str]) -> Mapping[str, Any]:
    """A DeepSpeed config file (JSON or hjson) or base64 string, read as DeepSpeed does."""
    try:
        try:
            from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
        except ImportError:  # an older DeepSpeed: plain JSON files only
            return json.loads(Path(source).read_text())
        return load_ds_config(os.fspath(source))
    except (OSError, ValueError) as exc:  # missing, unreadable, not JSON, not UTF-8
        raise ConfigError(
            f"ccld config: the DeepSpeed config {shown(os.fspath(source))} cannot be read "
            f"({problem(exc)}); expected a JSON file or a dict"
        ) from None


def ccld_block(source: Any) -> Mapping[str, Any] | None:
    """The top-level ``"ccld"`` block of a DeepSpeed config, or None when it has none.

    ``source`` is a config dict, the path of a config file, or an engine (whose
    ``engine.config`` is the dict DeepSpeed parsed; ``engine._config._param_dict`` is the
    same dict, kept as a fallback).
    """
    if source is None:
        return None
    if isinstance(source, Mapping):
        cfg: Any = source
    elif isinstance(source, (str, os.PathLike)):
        cfg = _load_ds_config(source)
        if not isinstance(cfg, Mapping):
            raise ConfigError(
                f"ccld config: the DeepSpeed config {shown(os.fspath(source))} holds a "
                f"{type(cfg).__name__}; expected a JSON object"
            )
    else:
        cfg = getattr(source, "config", None)
        if not isinstance(cfg, Mapping):
            cfg = getattr(getattr(source, "_config", None), "_param_dict", None)
        if not isinstance(cfg, Mapping):
            return None
    block = cfg.get(BLOCK_KEY)
    if block is not None and not isinstance(block, Mapping):
        raise ConfigError(
            f"ccld config: the DeepSpeed config's {BLOCK_KEY!r} must be an object, "
            f"not {type(block).__name__}"
        )
    return block


def read_config(source: Any, overrides: Iterable[str] = ()) -> CcldConfig | None:
    """The validated plugin config of a DeepSpeed config (see :func:`ccld_block`), with
    ``KEY=VALUE`` overrides merged into the block; None when there is no block. A bad key
    or value raises :class:`~ccld_plugin.ConfigError` even when the block is disabled."""
    block = ccld_block(source)
    if block is None:
        return None
    return load_config(dict(block), overrides)
