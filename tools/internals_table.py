"""The table of the frameworks' internals the plugin relies on, in docs/integrations.md, read
from ``ccld_plugin/integrations/internals.py``.

    python tools/internals_table.py           # rewrite the table between the markers
    python tools/internals_table.py --check   # exit 1 when the table there is stale

tests/unit/test_framework_internals.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "integrations.md"
START, END = "<!-- internals-table: start -->", "<!-- internals-table: end -->"


def table() -> str:
    sys.path.insert(0, str(REPO))
    from ccld_plugin.integrations.internals import INTERNALS

    rows = [
        "| framework | internal | what the plugin does with it | relies on | in |",
        "| --- | --- | --- | --- | --- |",
    ]
    for e in INTERNALS:
        needs = [f"`{p}`" for p in e.params]
        if e.position is not None:
            needs[-1] += f" (parameter {e.position})"
        needs += [f"`self.{a}`" for a in e.instance_attrs]
        rows.append(
            f"| {e.framework} | `{e.module}.{e.name}` | {e.use} | {', '.join(needs) or '-'} "
            f"| `{e.where}` |"
        )
    return "\n".join(rows)


def with_table(text: str, rows: str) -> str:
    """``text`` with ``rows`` between its markers."""
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"{DOC.name} has no {START} ... {END} markers")
    return f"{head}{START}\n{rows}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the table is stale")
    args = p.parse_args(argv)
    text = DOC.read_text()
    new = with_table(text, table())
    if args.check:
        if new != text:
            print(f"{DOC.name}: the internals table is stale; run tools/internals_table.py")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
