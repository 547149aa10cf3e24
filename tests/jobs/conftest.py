"""On a job test's failure, its recorded diagnosis again, with the detectors' reasons: a
CI run's folders do not come back, and a miss without them cannot be told apart."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from ccld_plugin.errors import log
from ccld_plugin.postmortem.replay import replay

SHOWN_LINES = 80


def replayed_reasons(recording: Path) -> str:
    """The debug lines of ``recording``'s rounds replayed (why each judgement came out as
    it did: a straggler not confirmed, a window's links), the last SHOWN_LINES of them."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        _, verdicts = replay(recording)
        lines = out.getvalue().splitlines()[-SHOWN_LINES:]
        lines.append(f"replayed verdicts: {[(v.kind.value, v.ranks, v.link) for v in verdicts]}")
    except Exception as exc:  # noqa: BLE001 - a report of a failure must not fail itself
        lines = [f"the replay of {recording} failed: {type(exc).__name__}: {exc}"]
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when != "call" or not report.failed or tmp is None:
        return
    for recording in sorted(Path(tmp).glob("**/rounds.rec"))[:2]:
        report.sections.append((f"ccld replay of {recording}", replayed_reasons(recording)))
