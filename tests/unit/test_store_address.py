"""``ccld diagnoser --store`` and ``--world``: what is accepted, and the one line for what
is not (the process-level checks are in tests/jobs/test_diagnoser_cli.py)."""

from __future__ import annotations

import pytest

from ccld_plugin.services.diagnoser_process import (
    MAX_WORLD,
    DiagnoserError,
    check_world,
    parse_store,
)


@pytest.mark.parametrize(
    "text, address",
    [
        ("127.0.0.1:29500", ("127.0.0.1", 29500)),
        ("node-7.cluster:1", ("node-7.cluster", 1)),
        ("[::1]:65535", ("::1", 65535)),
        ("[fe80::1%eth0]:29500", ("fe80::1%eth0", 29500)),
    ],
)
def test_store_addresses_accepted(text: str, address: tuple[str, int]) -> None:
    assert parse_store(text) == address


@pytest.mark.parametrize(
    "text, why",
    [
        ("127.0.0.1:0", "port 0 is not one a store can listen on; expected 1..65535"),
        ("127.0.0.1:99999", "port 99999 is not one a store can listen on"),
        ("::1:29500", "an IPv6 address goes in brackets before its port, e.g. [::1]:29500"),
        ("[::1]", "an IPv6 address goes in brackets"),
        ("[10.0.0.1]:5", "'10.0.0.1' in brackets is not an IPv6 address"),
        ("host", "expected HOST:PORT"),
        (":29500", "expected HOST:PORT"),
        ("host:", "expected HOST:PORT"),
        ("host:-1", "expected HOST:PORT"),
        ("host:٣", "expected HOST:PORT"),  # a digit, but not an ASCII one
    ],
)
def test_bad_store_addresses_are_one_line(text: str, why: str) -> None:
    with pytest.raises(DiagnoserError) as err:
        parse_store(text)
    assert str(err.value).startswith(f"ccld diagnoser: --store {text!r}: ")
    assert why in str(err.value) and "\n" not in str(err.value)


def test_world_bounds() -> None:
    check_world(1)
    check_world(MAX_WORLD)
    for world in (0, -1, MAX_WORLD + 1, 99_999_999):
        with pytest.raises(DiagnoserError, match=f"--world {world} is not allowed"):
            check_world(world)
