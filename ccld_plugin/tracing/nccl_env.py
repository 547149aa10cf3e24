"""Loading the NCCL profiler plugin: channel-level progress of GPU collectives.

The native probe library (``libnccl-profiler-ccld.so``, installed beside the ``_native``
extension) is also an NCCL profiler plugin. NCCL loads it from ``NCCL_PROFILER_PLUGIN``;
because the extension links the same file, NCCL and the tracer share one board and one
thread-local trace id in the process.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["LIBRARY_NAME", "enable_nccl_profiler_env", "nccl_plugin_path"]

LIBRARY_NAME = "libnccl-profiler-ccld.so"
ENV_VAR = "NCCL_PROFILER_PLUGIN"

_log = logging.getLogger(__name__)


def nccl_plugin_path() -> str:
    """Absolute path of the plugin library inside the installed package.

    Looks in the package's directories (an editable install has the source directory and
    the build's install directory), preferring the one that holds ``_native*.so``: that is
    the copy the extension has loaded, and NCCL must load the same file to share its state.

    Raises:
        FileNotFoundError: the package was installed without its native part.
    """
    spec = importlib.util.find_spec("ccld_plugin")  # where the package lies, not its names
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    found: list[Path] = []
    for entry in dirs:
        d = Path(entry)
        lib = d / LIBRARY_NAME
        if lib.is_file():
            if any(d.glob("_native*.so")):
                return str(lib.resolve())
            found.append(lib)
    if found:
        return str(found[0].resolve())
    raise FileNotFoundError(
        f"{LIBRARY_NAME} not found in the ccld_plugin package ({', '.join(dirs)}); "
        "reinstall ccld-plugin with its native part"
    )


def enable_nccl_profiler_env(env: MutableMapping[str, str] | None = None) -> str:
    """Point ``NCCL_PROFILER_PLUGIN`` at our plugin, unless it is already set.

    NCCL reads the variable once, when it initializes (the first communicator of the
    process), so this must run before that: before the first NCCL collective, or before
    launching the worker when ``env`` is a child's environment. An existing value is kept:
    the user chose another profiler, and NCCL loads only one.

    Args:
        env: the environment to change; ``os.environ`` by default.

    Returns:
        The value of ``NCCL_PROFILER_PLUGIN`` in ``env`` afterwards.
    """
    target = os.environ if env is None else env
    current = target.get(ENV_VAR)
    if current:
        if Path(current).name != LIBRARY_NAME:
            _log.info(
                "%s=%s is kept: NCCL channel progress will not reach the board", ENV_VAR, current
            )
        return current
    path = nccl_plugin_path()
    target[ENV_VAR] = path
    return path
