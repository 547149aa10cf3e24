"""The layout's rules, checked: data flows one way (hooks -> board -> agent -> control plane
-> diagnoser -> sinks), the analysis loads without torch or the native module, the product
never imports the test harness, and no two modules import each other."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

PACKAGE = REPO / "ccld_plugin"

# What each part of the package may import from the package (beyond itself). Parts not
# listed (cli, the harness) may import anything; nothing but cli may import the harness.
ALLOWED: dict[str, set[str]] = {
    # the config's schema, over how its input is read: values by type, a file's text
    "config": {"config_values", "config_file"},
    "config_values": set(),
    "config_file": {"config_values"},
    "errors": set(),
    "private_files": set(),
    "regular_files": set(),  # opening what must be a regular file: the readers' one way
    "wire": {"private_files", "regular_files"},
    "board": {"_native", "wire", "errors", "private_files", "regular_files"},
    "control": {"config", "wire", "errors"},
    "agent": {"_native", "board", "control", "config", "wire", "errors"},
    "diagnose": {"config", "wire", "errors"},
    "sinks": {"config", "diagnose", "wire", "errors", "private_files"},
    # the session starts the services: the only place that wires agent, control plane,
    # diagnoser and sinks together
    "runtime": {
        "",
        "_native",
        "agent",
        "board",
        "config",
        "control",
        "diagnose",
        "errors",
        "private_files",
        "sinks",
        "wire",
    },
    # after the job: the agent's board summary and the diagnoser, over boards left behind
    "postmortem": {"agent", "board", "config", "diagnose", "regular_files", "sinks", "wire"},
    "integrations": {"", "config", "config_values", "errors", "runtime"},
    "megatron": {"integrations"},
    "deepspeed": {"integrations"},
    "": {"config", "runtime"},  # ccld_plugin/__init__.py: the public names, lazily
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULE_NAMES = set(MODULES) | {"ccld_plugin._native"}


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The ccld_plugin modules a file imports (anywhere in it, or at module level only)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "ccld_plugin" and not node.module.startswith("ccld_plugin."):
                continue
            # ``from pkg import mod`` depends on the module, not on the package's __init__
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found.update(subs & MODULE_NAMES or {node.module})
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ccld_plugin"))
    return found


def _part(module: str) -> str:
    """``ccld_plugin.agent.tcp_probe`` -> ``agent``; the package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_part_imports_only_what_is_upstream_of_it(module: str) -> None:
    part = _part(module)
    deps = {_part(d) for d in _imports(MODULES[module])} - {part}
    if part != "cli" and part != "harness":
        assert "harness" not in deps, f"{module} imports the test harness"
    if part in ALLOWED:
        assert deps <= ALLOWED[part], f"{module} imports {sorted(deps - ALLOWED[part])}"


def test_no_module_level_import_cycle() -> None:
    graph = {
        m: {d for d in _imports(p, top_level_only=True) if d in MODULES and d != m}
        for m, p in MODULES.items()
    }
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            pytest.fail("import cycle: " + " -> ".join([*path[path.index(m) :], m]))
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_services_do_not_reach_back_into_the_session() -> None:
    assert "ccld_plugin.runtime.session" not in _imports(PACKAGE / "runtime" / "services.py")


@pytest.mark.parametrize(
    "module", ["ccld_plugin.diagnose", "ccld_plugin.wire", "ccld_plugin.sinks", "ccld_plugin"]
)
def test_loads_without_torch_or_the_native_module(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "print(sorted(m for m in ('torch', 'ccld_plugin._native') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
