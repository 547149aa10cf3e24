"""ccld-plugin's start-up hook: installed at the root of site-packages and imported at
interpreter start by ``ccld_autoload.pth`` (by ``ccld_autoload.start`` from Python 3.15 on,
PEP 829), in every Python process of the environment.

``install()`` puts one finder on ``sys.meta_path`` that answers only for the modules in
``WATCHED`` (a set look-up, ~0.1 us, for every other import). When one of them is
imported, its own code runs first, then ccld_plugin's patch for it
(``ccld_plugin.integrations.autoload``), imported only then: a process that imports
neither DeepSpeed nor Megatron loads nothing of ccld_plugin. The patches turn the plugin
on only where the job asks for it (a ``"ccld"`` block in the DeepSpeed config,
``--ccld`` on Megatron-LM's command line). ``CCLD_AUTOLOAD=0`` turns the hook off.

Only ``os`` and ``sys`` are imported here. An error in a patch is printed in one line and
the import goes on; an error in the watched module's own code reaches its importer as it
would without this hook.
"""

import os
import sys

# Neither typing nor __future__ is imported (this runs at every interpreter start): the
# annotations are strings.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from importlib.machinery import ModuleSpec
    from types import ModuleType

__all__ = ["OFF_VALUES", "WATCHED", "after_import", "install"]

# The modules ccld_plugin.integrations.autoload patches (a unit test keeps them equal).
WATCHED = frozenset(
    {
        "deepspeed",
        "megatron.core.parallel_state",
        "megatron.training.arguments",
        "megatron.training.training",
    }
)
OFF_VALUES = ("0", "false", "no", "off")

# module name -> callbacks to run once it has executed
_callbacks: "dict[str, list[Callable[[ModuleType], None]]]" = {}
_installed: "list[bool]" = []  # [True] once install() has run


class _AfterImport:
    """The one finder: for a module with callbacks it finds the spec with the finders
    after it and runs the callbacks right after the module's code (``exec_module``)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> "ModuleSpec | None":
        if fullname not in _callbacks:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_call(module: "ModuleType") -> None:
            exec_module(module)  # the module's own errors propagate unchanged
            for callback in _callbacks.pop(fullname, ()):
                _call(callback, module)

        loader.exec_module = exec_then_call
        return spec

    def invalidate_caches(self) -> None:
        pass


_finder = _AfterImport()


def _call(callback: "Callable[[ModuleType], None]", module: "ModuleType") -> None:
    try:
        callback(module)
    except Exception as exc:  # never break the importer: one line, and the import goes on
        why = " ".join(str(exc).split())
        print(f"ccld: {module.__name__}: {type(exc).__name__}: {why}", file=sys.stderr)


def after_import(name: str, callback: "Callable[[ModuleType], None]") -> None:
    """Call ``callback(module)`` once module ``name`` has executed (at once if it has)."""
    module = sys.modules.get(name)
    if module is not None:
        _call(callback, module)
        return
    _callbacks.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _patch(module: "ModuleType") -> None:
    from ccld_plugin.integrations.autoload import patch

    patch(module)


def install() -> None:
    """Watch the framework modules the plugin patches, unless ``CCLD_AUTOLOAD`` is off;
    a second call does nothing."""
    if _installed or os.environ.get("CCLD_AUTOLOAD", "").strip().lower() in OFF_VALUES:
        return
    _installed.append(True)
    for name in sorted(WATCHED):
        after_import(name, _patch)
