"""The picture of the packages and their imports in CONTRIBUTING.md, read from the code.

    python tools/layout_graph.py           # rewrite the graph between the markers
    python tools/layout_graph.py --check   # exit 1 when the graph there is stale

A part is a top-level module or package of ccld_plugin, or ccld_harness beside it. In
diagnose/ each capability (stalls/, compute/, links/) is a part, and so are the shared
modules they all read and the analysis over them. An arrow A --> B says that A imports B
(dotted: only inside a function or for type checking, not when A is loaded); an arrow that
others already imply (A --> B --> C, and A --> C) is left out. tests/unit/test_layout.py
reads the imports through this module too, and fails when the picture is stale.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("ccld_plugin", "ccld_harness")  # the product, and the harness beside it
CONTRIBUTING = REPO / "CONTRIBUTING.md"
START, END = "<!-- layout-graph: start -->", "<!-- layout-graph: end -->"
# diagnose/'s analysis: the round over every capability, and the slow detector's windows
DIAGNOSE_ANALYSIS = (
    "ccld_plugin.diagnose",
    "ccld_plugin.diagnose.analyzer",
    "ccld_plugin.diagnose.slow",
)
CAPABILITIES = ("stalls", "compute", "links")


def modules(repo: Path = REPO) -> dict[str, Path]:
    """Every module of the product and the harness, by dotted name."""
    found = {}
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, names: Iterable[str], top_level_only: bool = False) -> set[str]:
    """The modules of ``names`` (or packages of ROOTS) that a file imports: anywhere in
    it, or only in its module body (what runs when it is loaded)."""
    known = set(names)
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in ROOTS:
                continue
            # ``from pkg import mod`` depends on the module, not on the package's __init__
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found.update(subs & known or {node.module})
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in ROOTS)
    return found


def part_of(module: str) -> str:
    """``ccld_plugin.probes.tcp_probe`` -> ``probes``; ``ccld_plugin.diagnose.links.ports``
    -> ``diagnose.links``; diagnose/'s shared modules -> ``diagnose.shared``; the package
    itself -> ``ccld_plugin``; anything of the harness -> ``ccld_harness``."""
    parts = module.split(".")
    if parts[0] == "ccld_harness" or len(parts) == 1:
        return parts[0]
    if parts[1] != "diagnose" or module in DIAGNOSE_ANALYSIS:
        return parts[1]
    return f"diagnose.{parts[2]}" if parts[2] in CAPABILITIES else "diagnose.shared"


def part_graph(repo: Path = REPO) -> dict[str, dict[str, bool]]:
    """part -> {imported part: whether some import of it runs when the part is loaded}."""
    mods = modules(repo)
    names = set(mods) | {"ccld_plugin._native"}
    graph: dict[str, dict[str, bool]] = {part_of(m): {} for m in mods}
    for m, path in mods.items():
        eager = {part_of(d) for d in imports(path, names, top_level_only=True)}
        for d in imports(path, names):
            part, dep = part_of(m), part_of(d)
            if dep != part:
                graph[part][dep] = graph[part].get(dep, False) or dep in eager
    return graph


def reduced(graph: dict[str, dict[str, bool]]) -> dict[str, dict[str, bool]]:
    """``graph`` without the arrows that a longer path already implies."""

    def reach(start: str, skip: str) -> set[str]:
        seen: set[str] = set()
        todo = [d for d in graph.get(start, {}) if d != skip]
        while todo:
            d = todo.pop()
            if d not in seen:
                seen.add(d)
                todo += graph.get(d, {})
        return seen

    return {a: {b: e for b, e in deps.items() if b not in reach(a, b)} for a, deps in graph.items()}


def _label(part: str, mods: Iterable[str]) -> str:
    """What a part's box says: its folder or file, and for diagnose/'s root its modules."""
    if part in ("diagnose", "diagnose.shared"):
        members = sorted(m.rsplit(".", 1)[1] for m in mods if m.count(".") == 2)
        return "diagnose/ " + ", ".join(members)
    if part.startswith("diagnose."):
        return part.split(".")[1] + "/"
    if part in ROOTS:
        return part + "/" if part == "ccld_harness" else "ccld_plugin/__init__"
    return part + ("/" if any(m.count(".") > 1 for m in mods) else ".py")


def mermaid(repo: Path = REPO) -> str:
    """The picture as a Mermaid flowchart (GitHub draws it)."""
    mods = modules(repo)
    graph = reduced(part_graph(repo))
    by_part: dict[str, list[str]] = {}
    for m in mods:
        by_part.setdefault(part_of(m), []).append(m)
    ident = {p: p.replace(".", "_").replace("ccld_plugin", "api") for p in graph}
    lines = ["```mermaid", "flowchart TD"]
    inner = sorted(p for p in graph if p.startswith("diagnose"))
    lines.append("  subgraph diagnose_pkg [diagnose/]")
    lines += [f'    {ident[p]}["{_label(p, by_part[p])}"]' for p in inner]
    lines.append("  end")
    lines += [f'  {ident[p]}["{_label(p, by_part[p])}"]' for p in sorted(graph) if p not in inner]
    for a in sorted(graph):
        for b, eager in sorted(graph[a].items()):
            if b in ident:  # (the native extension is no module of the tree)
                lines.append(f"  {ident[a]} {'-->' if eager else '-.->'} {ident[b]}")
    lines.append("```")
    return "\n".join(lines)


def with_graph(text: str, graph: str) -> str:
    """``text`` with ``graph`` between its markers."""
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"CONTRIBUTING.md has no {START} ... {END} markers")
    return f"{head}{START}\n{graph}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the graph is stale")
    args = p.parse_args(argv)
    text = CONTRIBUTING.read_text()
    new = with_graph(text, mermaid())
    if args.check:
        if new != text:
            print("CONTRIBUTING.md: the layout graph is stale; run tools/layout_graph.py")
            return 1
        return 0
    CONTRIBUTING.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
