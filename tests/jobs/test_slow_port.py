"""A slow port names its rank; a slow connection names its link (issue 14 item 5).

Real 4-rank TP2xPP2 jobs on the built-in torch workload, every rank in its own network
namespace (ccld_plugin.harness.netjob). Rank 3 has links in two groups: its TP peer 2 and
its PP peer 1. ``comm-slow@3`` shapes its whole link (every connection of rank 3: a slow
NIC or switch port); ``comm-slow@2:peer=3`` shapes only the traffic between ranks 2 and 3
(one connection), and leaves every other link of both alone. Traffic: a few MB per step
between the run's namespaces, 30 steps at most; every namespace is removed at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from job_runner import FAST_UNRESPONSIVE, demo, facts, only

from ccld_plugin.harness.faults import netns, parse_fault

# Slowness keeps the default hang floor: on a loaded 2-core host a first step can keep the
# other ranks waiting 3 s, which the short floor of the hang tests would flag.
NO_SHORT_HANGS = ("diagnoser.hang_min_s=10",)
TP2PP2_GROUP_OF = {  # the layout's groups: which one a link of two ranks belongs to
    frozenset({0, 1}): "tp",
    frozenset({2, 3}): "tp",
    frozenset({0, 2}): "pp",
    frozenset({1, 3}): "pp",
}


@pytest.fixture(autouse=True)
def _closed_network() -> None:
    ok, why = netns.available()
    if not ok:
        pytest.skip(why)


def _ours() -> list[str]:
    """Namespaces and state files of networks this process owns (other runs may be going
    on at the same time: only ours must be gone)."""
    runs = []
    for f in netns.STATE_DIR.glob("*.json") if netns.STATE_DIR.is_dir() else []:
        try:
            if json.loads(f.read_text()).get("pid") == os.getpid():
                runs.append(f.stem)
        except (OSError, ValueError):
            continue
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    names = [ln.split()[0] for ln in out.stdout.splitlines()]
    return [f"state file {r}.json" for r in runs] + [
        n for n in names if any(n.startswith(f"{netns.PREFIX}{r}-") for r in runs)
    ]


def netns_demo(tmp_path: Path, steps: int, *faults: str) -> tuple[int, dict]:
    """A 4-rank TP2xPP2 torch demo in a closed network, which must leave no namespace
    behind."""
    result = demo(
        tmp_path / "out",
        *faults,
        world=4,
        tp=2,
        pp=2,
        steps=steps,
        netns=True,
        overrides=FAST_UNRESPONSIVE,
        extra=NO_SHORT_HANGS,
        timeout_s=150,
        framework="torch",
    )
    assert _ours() == [], "the run left its network behind"
    return result


def _slow_links(v: dict) -> set[frozenset[int]]:
    return {
        frozenset((e["data"]["rank"], e["data"]["peer"])) for e in facts(v["evidence"])["link_slow"]
    }


def test_pair_spec_reads_back() -> None:
    f = parse_fault("comm-slow@2:rate=30mbit,peer=3")
    assert (f.rank, f.peer, f.rate) == (2, 3, "30mbit") and parse_fault(str(f)) == f
    assert parse_fault("comm-slow@2:rate=30mbit").peer is None


def test_slow_port_names_its_rank_with_its_links_in_both_groups(tmp_path: Path) -> None:
    # Every link of rank 3 is shaped: its TP link to 2 and its PP link to 1 are slow, their
    # siblings 0<->1 (TP) and 0<->2 (PP) are not. Rank 3 is named, not the pair 2, 3.
    code, summary = netns_demo(tmp_path, 30, "comm-slow@3:rate=30mbit,step=3")
    v = only(summary, "slow", "communication")
    assert (v["ranks"], v["link"]) == ([3], None), v["evidence"]
    assert 3 in v["group"]["ranks"]
    links = _slow_links(v)
    assert all(3 in pair for pair in links), links
    assert {TP2PP2_GROUP_OF[p] for p in links} == {"tp", "pp"}, links
    assert [e["data"] for e in facts(v["evidence"])["common_rank"]] == [{"rank": 3}]
    assert len(summary["verdicts"]) == 1 and code == 0
    assert summary["latency_s"][0]["steps_to_verdict"] <= 17


def test_one_slow_connection_names_the_link(tmp_path: Path) -> None:
    # Only the traffic between ranks 2 and 3 is shaped: rank 3's PP link to 1 and rank
    # 2's PP link to 0 are healthy, so neither end is to blame alone.
    code, summary = netns_demo(tmp_path, 30, "comm-slow@2:rate=30mbit,peer=3,step=3")
    v = only(summary, "slow", "communication")
    assert (v["ranks"], v["link"], v["group"]["role"]) == ([2, 3], [2, 3], "tp"), v["evidence"]
    assert _slow_links(v) == {frozenset({2, 3})}
    assert facts(v["evidence"])["one_link"]
    assert len(summary["verdicts"]) == 1 and code == 0
    # A link is confirmed a window later than a rank (LINK_EXTRA_WINDOWS).
    assert summary["latency_s"][0]["steps_to_verdict"] <= 22
