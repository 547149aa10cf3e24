"""Put first on PYTHONPATH by ``ccld run``: Python imports it at interpreter start, in
every process of the job. It turns the plugin on in training ranks (where the launcher
set RANK) and then runs the sitecustomize it stands in front of, if there is one."""

import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    """Run the next sitecustomize on the path, under the name, as if this one were not
    there (the import system then takes it as the module it imported)."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if "CCLD_RUN_CONFIG" in os.environ and "RANK" in os.environ:
    try:
        from ccld_plugin.integrations.autostart import start

        start()
    except Exception as exc:  # noqa: BLE001 - never stop the user's script from starting
        print(f"ccld run: the plugin is off in this rank: {exc}", file=sys.stderr)
_chain()
