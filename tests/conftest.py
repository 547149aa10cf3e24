"""Fixtures shared by the test tiers (unit/, native/, jobs/)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from cbuild import build_probe_library
from hypothesis import settings
from verdict_schema import schema_problems, verdict_files

TIERS = ("unit", "native", "jobs")

# The fuzz tests draw the same examples on every run, so that a test run (CI's above all)
# passes or fails on the code, not on the draw. To look for new failing inputs:
# HYPOTHESIS_PROFILE=explore pytest tests/unit/test_fuzz_parsers.py (random draws).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def verdicts_follow_the_schema(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every verdicts file a test leaves in its tmp_path holds records of the JSON Schema
    the package ships (``ccld_plugin/diagnose/verdict.schema.json``)."""
    yield
    tmp = getattr(request.node, "funcargs", {}).get("tmp_path")
    if tmp is None or request.node.get_closest_marker("bad_verdicts"):
        return
    problems = [p for f in verdict_files(Path(tmp)) for p in schema_problems(f)]
    assert not problems, "verdict records that break the schema:\n" + "\n".join(problems[:20])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier, the folder it lives in (``-m unit`` and so on)."""
    for item in items:
        tier = next((t for t in TIERS if t in item.path.parts), None)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Collects the sockets a test opens and closes them however the test ends."""
    opened: list[socket.socket] = []
    yield opened
    for s in opened:
        s.close()


@pytest.fixture(scope="session")
def probe_library(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The native probe library built from the checkout once per session (path, compiler
    output): the tests read the C sources they check, not an installed copy."""
    return build_probe_library(tmp_path_factory.mktemp("probe_library"))
