"""The dedicated store listens on MASTER_ADDR's address only (TCPStore alone would take
every interface), and says in one line when that address is not this host's."""

from __future__ import annotations

from pathlib import Path

import pytest

from ccld_harness.launch import free_port
from ccld_plugin.config import ControlConfig
from ccld_plugin.control import ControlPlane


def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                found.add(addr)
    return found


def test_the_dedicated_store_listens_on_the_job_address_only(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port - 1))
    plane = ControlPlane(ControlConfig(store="dedicated"), 0, 1, "j", 0)
    plane.store.set("k", "v")
    assert _listeners(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 or ::
    client = ControlPlane(ControlConfig(store="dedicated"), 0, 1, "j", 1)  # not hosting
    assert bytes(client.store.get("k")) == b"v"


def test_an_address_of_another_host_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: never this host's
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(OSError, match="cannot listen on MASTER_ADDR 192.0.2.1") as info:
        ControlPlane(ControlConfig(store="dedicated"), 0, 1, "j", 0)
    assert "\n" not in str(info.value)
