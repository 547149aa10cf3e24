"""The layout's rules, checked: data flows one way (tracing -> board -> agent and its probes
-> control plane -> diagnose -> sinks; the services wire them, the post-mortem comes
after), diagnose's capabilities read a shared view and records and not each other, the
analysis loads without torch or the native module, the product imports the harness in
one place only, no two modules or parts import each other, modules and packages stay
small, and CONTRIBUTING.md's picture of the parts is the code's."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

_spec = importlib.util.spec_from_file_location("layout_graph", REPO / "tools" / "layout_graph.py")
assert _spec is not None and _spec.loader is not None
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)

MODULES: dict[str, Path] = layout.modules()
NAMES = set(MODULES) | {"ccld_plugin._native"}
PRODUCT = sorted(m for m in MODULES if m.split(".")[0] == "ccld_plugin")
MAX_MODULE_LINES = 600  # a module is shorter than this
MAX_PACKAGE_MODULES = 12  # a package holds fewer modules than this (its __init__ included)

# what every part may read
FOUNDATION = {"config", "config_values", "errors", "files", "topology", "wire"}
DIAGNOSE = {"diagnose", "diagnose.shared", "diagnose.stalls", "diagnose.compute", "diagnose.links"}
# What each part of the product may import from the product (beyond itself); a part that
# is not listed fails. Upstream first, in the order data flows.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    # how the config's input is read (values by type, a file's text), under its schema
    "config_values": set(),
    "config_file": {"config_values", "files"},
    "config": {"config_values", "config_file"},
    # opening files: what the plugin writes (no link followed), what readers take (only
    # a regular file, never a wait)
    "files": set(),
    "topology": set(),
    "wire": set(),
    # the replay format: written by services, read after
    "recording": {"files", "topology", "wire"},
    # inside the training thread, then what it writes
    "tracing": {"_native", "errors", "topology", "wire"},
    "board": {"_native", "errors", "files", "topology", "wire"},
    # the link probes beside the agent, the agent, the store it publishes to
    "probes": {"_native", "errors", "wire"},
    "agent": {"_native", "board", "probes", "control"} | FOUNDATION,
    "control": FOUNDATION,
    # the analysis, pure: each capability over the shared view and records, links read by
    # the stalls they locate, the round over them all on top
    "diagnose.shared": FOUNDATION,
    "diagnose.links": {"diagnose.shared"} | FOUNDATION,
    "diagnose.stalls": {"diagnose.shared", "diagnose.links"} | FOUNDATION,
    "diagnose.compute": {"diagnose.shared"} | FOUNDATION,
    "diagnose": DIAGNOSE | FOUNDATION,
    # (Prometheus shows the links' own figures: diagnose.links)
    "sinks": {"diagnose", "diagnose.shared", "diagnose.links"} | FOUNDATION,
    # what a rank starts: the only place that wires tracing, agent, control plane,
    # diagnoser and sinks together
    "services": {"_native", "tracing", "board", "probes", "agent", "control", "recording"}
    | DIAGNOSE
    | {"sinks"}
    | FOUNDATION,
    # after the job: the agent's board summary and the analysis, over boards left behind
    "postmortem": {"board", "probes", "agent", "recording", "sinks"} | DIAGNOSE | FOUNDATION,
    "integrations": {"ccld_plugin", "services", "config", "config_values", "errors"},
    "megatron": {"integrations"},
    "deepspeed": {"integrations"},
    # ccld_plugin/__init__.py: the public names, lazily
    "ccld_plugin": {"config", "services", "sinks"},
    # what the product documents about itself, read from the code: the config's keys
    "reference": {"config", "config_values"},
    # the command line: a front over every part (the harness: see below)
    "cli": {
        "board",
        "config",
        "integrations",
        "postmortem",
        "reference",
        "services",
        "sinks",
        "ccld_harness",
        "ccld_plugin",
    },
}
HARNESS_GATE = ("ccld_plugin.cli", "_demo")  # the one function of the product that runs it


def _parts_imported(module: str) -> set[str]:
    part = layout.part_of(module)
    return {layout.part_of(d) for d in layout.imports(MODULES[module], NAMES)} - {part}


@pytest.mark.parametrize("module", PRODUCT)
def test_each_part_imports_only_what_is_upstream_of_it(module: str) -> None:
    part = layout.part_of(module)
    assert part in ALLOWED, f"{module}: part {part!r} has no rule in ALLOWED"
    deps = _parts_imported(module)
    assert deps <= ALLOWED[part], f"{module} imports {sorted(deps - ALLOWED[part])}"


def _harness_imports(tree: ast.AST) -> list[ast.stmt]:
    return [
        node
        for node in ast.walk(tree)
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ccld_harness"))
        or (
            isinstance(node, ast.Import)
            and any(a.name.split(".")[0] == "ccld_harness" for a in node.names)
        )
    ]


def test_the_product_imports_the_harness_only_where_ccld_demo_runs() -> None:
    gate_module, gate_function = HARNESS_GATE
    for module in PRODUCT:
        tree = ast.parse(MODULES[module].read_text())
        found = _harness_imports(tree)
        if module == gate_module:
            gates = [
                n
                for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef) and n.name == gate_function
            ]
            allowed = {id(n) for g in gates for n in _harness_imports(g)}
            found = [n for n in found if id(n) not in allowed]
        lines = [n.lineno for n in found]
        assert not found, f"{module} imports ccld_harness (line {lines}), outside {HARNESS_GATE}"


def test_no_module_level_import_cycle() -> None:
    graph = {
        m: {d for d in layout.imports(p, NAMES, top_level_only=True) if d in MODULES and d != m}
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


def test_no_two_parts_import_each_other() -> None:
    graph = layout.part_graph()
    for a in sorted(graph):
        seen, todo = set(), list(graph[a])
        while todo:
            b = todo.pop()
            assert b != a, f"part {a} imports itself through {sorted(seen)}"
            if b not in seen:
                seen.add(b)
                todo += graph.get(b, {})


def test_services_do_not_reach_back_into_the_session() -> None:
    imported = layout.imports(MODULES["ccld_plugin.services.rank_services"], NAMES)
    assert "ccld_plugin.services.session" not in imported


@pytest.mark.parametrize(
    "module",
    [
        "ccld_plugin.diagnose",
        "ccld_plugin.wire",
        "ccld_plugin.topology",
        "ccld_plugin.recording",
        "ccld_plugin.sinks",
        "ccld_plugin",
    ],
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


def test_every_module_is_under_600_lines() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) >= MAX_MODULE_LINES
    }
    assert not long, f"modules of {MAX_MODULE_LINES} lines or more: {long}"


def test_every_package_holds_under_12_modules() -> None:
    packages: dict[str, int] = {}
    for p in MODULES.values():
        folder = str(p.parent.relative_to(REPO))
        packages[folder] = packages.get(folder, 0) + 1
    big = {folder: n for folder, n in packages.items() if n >= MAX_PACKAGE_MODULES}
    assert not big, f"packages of {MAX_PACKAGE_MODULES} modules or more: {big}"


def test_the_picture_in_contributing_is_the_code() -> None:
    text = layout.CONTRIBUTING.read_text()
    assert layout.with_graph(text, layout.mermaid()) == text, (
        "CONTRIBUTING.md's layout graph is stale: run python tools/layout_graph.py"
    )


def test_no_two_test_files_share_a_name() -> None:
    # pytest imports test files by their basename (the folders are not packages): two
    # of one name stop the whole run at collection
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"test files of one name: {twice}"
