"""The README and the docs: the README stays a first screen, its links lead somewhere, and
neither tells the history of the work or names the machine it was done on. (The site's own
links and nav are checked by ``make docs``, MkDocs in strict mode.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from paths import REPO

PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]
HISTORY = re.compile(
    r"\bsessions? \d+|\bthis (?:session|version)\b|\b(?:previous|earlier) version\b|"
    r"\bcommit [0-9a-f]{7}|\bthis (?:2-core )?(?:VM|machine)\b",
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
    assert not found, f"history or the machine of the work in the docs: {found}"


def test_the_readmes_links_lead_somewhere() -> None:
    targets = [t for t in LINK.findall((REPO / "README.md").read_text()) if "://" not in t]
    missing = [t for t in targets if not (REPO / t).exists()]
    assert targets and not missing, f"README.md links to missing files: {missing}"
