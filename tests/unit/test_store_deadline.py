"""Store requests that give up in time (control/deadline.py), and who stands by for the
diagnoser (services/standby.standby_rank)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from ccld_plugin.control.deadline import DeadlineStore, StoreTimeout
from ccld_plugin.services.standby import standby_rank


class _CutLinkStore:
    """What torch's TCPStore client does on a cut link: ``check`` waits in recv() until
    the link comes back (here: until ``restore``), whatever its timeout says."""

    def __init__(self) -> None:
        self.timeout: timedelta | None = None
        self.link = threading.Event()
        self.link.set()

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def check(self, keys: list[str]) -> bool:
        self.link.wait()
        return bool(keys)

    def get(self, key: str) -> bytes:
        raise KeyError(key)


def test_a_request_on_a_cut_link_gives_up_and_the_next_fail_at_once() -> None:
    inner = _CutLinkStore()
    store = DeadlineStore(inner)
    assert store.check(["a"]) is True  # no deadline yet: in the caller's thread
    store.set_deadline(0.3)
    assert inner.timeout == timedelta(seconds=0.3)
    inner.link.clear()
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="did not answer a check within 0.3 s"):
        store.check(["a"])
    assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="has not answered a check"):
        store.check(["b"])  # the first is still stuck: no second request on that link
    assert time.monotonic() - t0 < 0.2
    inner.link.set()  # the link is back: the stuck request returns, the next go through
    time.sleep(0.05)
    assert store.check(["c"]) is True
    with pytest.raises(KeyError):  # the store's own errors reach the caller as they are
        store.get("missing")


def test_the_standby_is_on_another_node_when_there_is_one() -> None:
    assert standby_rank(0, world=16, ranks_per_node=8, chosen=-1) == 8
    assert standby_rank(12, world=16, ranks_per_node=8, chosen=-1) == 4
    assert standby_rank(0, world=4, ranks_per_node=4, chosen=-1) == 1  # one node
    assert standby_rank(3, world=4, ranks_per_node=0, chosen=-1) == 0  # unknown: next
    assert standby_rank(0, world=4, ranks_per_node=4, chosen=2) == 2
    assert standby_rank(-1, world=4, ranks_per_node=4, chosen=-1) == 0  # ccld diagnoser
    assert standby_rank(0, world=1, ranks_per_node=1, chosen=-1) is None
    assert standby_rank(2, world=4, ranks_per_node=4, chosen=2) is None  # itself
