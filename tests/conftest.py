"""Fixtures shared by the test modules."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Collects the sockets a test opens and closes them however the test ends."""
    opened: list[socket.socket] = []
    yield opened
    for s in opened:
        s.close()
