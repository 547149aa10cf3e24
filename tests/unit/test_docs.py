"""The README and the docs: the README stays a first screen, its links lead somewhere, and
neither tells the history of the work or names the machine it was done on. (The site's own
links and nav are checked by ``make docs``, MkDocs in strict mode.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from paths import REPO

PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]
HISTORY = re.compile(
    r"\bsessions? \d+|\bthis (?:session|version)\b|\b(?:previous|earlier) version\b|"
    r"\bcommit [0-9a-f]{7}|\bthis (?:2-core )?(?:VM|machine)\b|"
    r"\bFIGURES-[A-Z]+|\bTODO\b",  # a figure still to measure is no figure
    re.IGNORECASE,
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_a_first_screen() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < 400, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_tells_the_history_of_the_work(page: Path) -> None:
    found = [
        f"{page.relative_to(REPO)}:{n}: {m[0]}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in HISTORY.finditer(line)
    ]
    assert not found, f"history, the machine of the work or a figure to come in the docs: {found}"


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    if isinstance(node, list):
        return [p for v in node for p in _nav_pages(v)]
    return []


def test_the_readme_links_every_page_of_the_docs_and_nothing_missing() -> None:
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    pages = {f"docs/{p}" for p in _nav_pages(nav) if p != "index.md"}
    targets = {t for t in LINK.findall((REPO / "README.md").read_text()) if "://" not in t}
    assert pages <= targets, f"README.md does not link {sorted(pages - targets)}"
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


CODE = [
    p
    for folder in ("ccld_plugin", "ccld_harness", "benchmarks", "tools", "tests", "examples")
    for p in sorted((REPO / folder).rglob("*"))
    if p.suffix in {".py", ".c", ".h", ".sh", ".yaml"} and p.name != "test_docs.py"
]
# in code, "this version" is a format's own (a board, a summary); what tells the work's
# history is a session, an issue or the project's machine
CODE_HISTORY = re.compile(
    r"\bsession(?:s|'s)? \d+|\bthis session\b|\bissue #?\d+|\bthis project's\b", re.IGNORECASE
)


def test_no_comment_tells_the_history_of_the_work() -> None:
    found = [
        f"{path.relative_to(REPO)}:{n}: {m[0]}"
        for path in CODE
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        for m in CODE_HISTORY.finditer(line)
    ]
    assert not found, f"history of the work in the code: {found}"
