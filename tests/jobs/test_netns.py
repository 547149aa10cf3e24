"""Closed-box network harness: links between rank namespaces, isolation, faults, cleanup.

All traffic is between namespaces these tests create, a few connections and at most a few
MB each, every process and connect bounded by a timeout.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ccld_harness.faults import netns
from ccld_harness.faults.netns import PREFIX, ClosedNetwork

NETNS_PY = Path(netns.__file__).resolve()
PORT = 5001
TIMEOUT_S = 20

SERVER = """
import socket, sys
ls = socket.create_server((sys.argv[1], int(sys.argv[2])))
ls.settimeout(15)
print("ready", flush=True)
c, _ = ls.accept()
c.settimeout(15)
n = 0
while chunk := c.recv(1 << 16):
    n += len(chunk)
c.sendall(n.to_bytes(8, "big"))
"""

# Sends argv[3] bytes; prints the byte count the server saw and the seconds it took.
CLIENT = """
import socket, sys, time
host, port, nbytes, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
try:
    c = socket.create_connection((host, port), timeout=timeout)
except OSError as e:
    print("connect-failed", type(e).__name__, flush=True)
    sys.exit(3)
c.settimeout(15)
t0 = time.perf_counter()
buf = b"z" * 65536
left = nbytes
while left > 0:
    left -= c.send(buf[: min(left, len(buf))])
c.shutdown(socket.SHUT_WR)
got = b""
while len(got) < 8 and (chunk := c.recv(8 - len(got))):
    got += chunk
print(int.from_bytes(got, "big"), time.perf_counter() - t0)
"""


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [ln.split()[0] for ln in out.stdout.splitlines() if ln.strip()]


def _ip_json(*args: str) -> list[dict]:
    out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout or "[]")


def _host_links() -> list[str]:
    return [link["ifname"] for link in _ip_json("link")]


def _leftovers(run_id: str) -> list[str]:
    ours = f"{PREFIX}{run_id}-"
    names = [n for n in _netns_names() if n.startswith(ours)]
    names += [n for n in _host_links() if n.startswith(PREFIX)]
    if (netns.STATE_DIR / f"{run_id}.json").exists():
        names.append(f"state file {run_id}.json")
    return names


@pytest.fixture(scope="module")
def net() -> Iterator[ClosedNetwork]:
    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    with ClosedNetwork(3) as n:
        yield n
    assert _leftovers(n.run_id) == []


def start_server(net: ClosedNetwork, rank: int) -> subprocess.Popen:
    """A one-connection sink in `rank` that replies with the byte count it received."""
    argv = [*net.exec_prefix(rank), sys.executable, "-c", SERVER, net.address(rank), str(PORT)]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()  # type: ignore[union-attr]
    if line.strip() != "ready":
        server.kill()
        server.wait(timeout=TIMEOUT_S)
        raise AssertionError(f"server in rank {rank} did not start: {line!r}")
    return server


def stop(server: subprocess.Popen) -> None:
    try:
        server.wait(timeout=5)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=TIMEOUT_S)


def client(
    net: ClosedNetwork, src: int, dst: int, nbytes: int, connect_timeout: float = 5.0
) -> subprocess.CompletedProcess:
    args = [net.address(dst), str(PORT), str(nbytes), str(connect_timeout)]
    argv = [*net.exec_prefix(src), sys.executable, "-c", CLIENT, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)


def transfer(net: ClosedNetwork, src: int, dst: int, nbytes: int) -> float:
    """Seconds to move `nbytes` from rank `src` to rank `dst` (process start excluded)."""
    server = start_server(net, dst)
    try:
        out = client(net, src, dst, nbytes)
        assert out.returncode == 0, out.stdout + out.stderr
        got, seconds = out.stdout.split()
        assert int(got) == nbytes
        return float(seconds)
    finally:
        stop(server)


def test_names_fit_and_carry_the_prefix(net: ClosedNetwork) -> None:
    for rank in range(net.num_ranks):
        assert net.netns(rank).startswith(PREFIX + net.run_id)
        assert len(net.switch_port(rank)) <= 15  # IFNAMSIZ - 1
        assert net.exec_prefix(rank) == ["ip", "netns", "exec", net.netns(rank)]
        assert ipaddress.ip_address(net.address(rank)) in net.subnet  # type: ignore[operator]
    assert len({net.address(r) for r in range(net.num_ranks)}) == net.num_ranks


def test_ranks_talk_over_the_bridge(net: ClosedNetwork) -> None:
    assert transfer(net, 1, 0, 64 * 1024) < TIMEOUT_S
    assert transfer(net, 0, 2, 64 * 1024) < TIMEOUT_S


def test_host_cannot_reach_ranks(net: ClosedNetwork) -> None:
    subnet = net.subnet
    assert subnet is not None
    # No address, no route, no interface of the box in the host namespace.
    host_ips = [a["local"] for iface in _ip_json("-4", "addr") for a in iface["addr_info"]]
    assert not [ip for ip in host_ips if ipaddress.ip_address(ip) in subnet]
    assert not [n for n in _host_links() if n.startswith(PREFIX)]
    dsts = [r["dst"] for r in _ip_json("-4", "route", "show", "table", "all")]
    assert not [d for d in dsts if d != "default" and subnet.overlaps(ipaddress.ip_network(d))]

    server = start_server(net, 0)
    try:
        # SO_DONTROUTE allows only on-link destinations: if the host had any path into
        # the box this connect would succeed; it fails at once instead, and, unlike a
        # plain connect, sends nothing out through the host's own default route.
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_DONTROUTE, 1)
            s.settimeout(1.0)
            t0 = time.monotonic()
            with pytest.raises(OSError) as info:
                s.connect((net.address(0), PORT))
            assert time.monotonic() - t0 < 1.5
            assert info.value.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, None)
        # The same server is reachable from inside the box.
        out = client(net, 1, 0, 1000)
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        stop(server)


def test_shape_slows_both_directions(net: ClosedNetwork) -> None:
    size = 2 * 1024 * 1024
    fast_out = transfer(net, 1, 0, size)
    fast_in = transfer(net, 0, 1, size)
    net.shape(1, "20mbit")
    try:
        slow_out = transfer(net, 1, 0, size)  # rank 1's egress: tbf on its eth0
        slow_in = transfer(net, 0, 1, size)  # into rank 1: tbf on the switch port
    finally:
        net.unshape(1)
    # 2 MiB at 20 Mbit/s is ~0.84 s; unshaped it is a few ms. Assert only a wide margin.
    assert slow_out > 3 * fast_out and slow_out > 0.4, (fast_out, slow_out)
    assert slow_in > 3 * fast_in and slow_in > 0.4, (fast_in, slow_in)
    assert transfer(net, 1, 0, size) < slow_out / 3  # unshape really removed it


def test_cut_blocks_connects_until_restored(net: ClosedNetwork) -> None:
    server = start_server(net, 2)
    try:
        net.cut(2)
        try:
            out = client(net, 1, 2, 1000, connect_timeout=1.0)
            assert out.returncode == 3 and "connect-failed" in out.stdout, out.stdout
        finally:
            net.restore(2)
        out = client(net, 1, 2, 1000)
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        stop(server)


def test_exit_removes_everything() -> None:
    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    with ClosedNetwork(2) as n:
        run_id = n.run_id
        assert sorted(x for x in _netns_names() if x.startswith(f"{PREFIX}{run_id}-")) == [
            f"{PREFIX}{run_id}-r0",
            f"{PREFIX}{run_id}-r1",
            f"{PREFIX}{run_id}-sw",
        ]
        n.shape(0)
        n.cut(1)  # faults in place at exit must not get in the way
    assert _leftovers(run_id) == []


# A process that owns a network and then waits to be signalled. It loads netns.py by path
# so that it does not pay for importing torch through the package.
OWNER = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("ccld_netns", {str(NETNS_PY)!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
net = mod.ClosedNetwork(1, sweep=False).open()
print(net.run_id, flush=True)
time.sleep(30)
"""


def _start_owner() -> tuple[subprocess.Popen, str]:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    run_id = owner.stdout.readline().strip()  # type: ignore[union-attr]
    if not run_id:
        owner.kill()
        owner.wait(timeout=TIMEOUT_S)
        raise AssertionError("owner process did not open a network")
    assert _leftovers(run_id), "owner's network is not there"
    return owner, run_id


def test_sigterm_removes_the_network() -> None:
    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    owner, run_id = _start_owner()
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=TIMEOUT_S) == -signal.SIGTERM  # still dies by the signal
    assert _leftovers(run_id) == []


def test_sweep_removes_runs_of_dead_owners_only(net: ClosedNetwork) -> None:
    owner, run_id = _start_owner()
    owner.kill()  # SIGKILL: no handler runs, the namespaces stay behind
    owner.wait(timeout=TIMEOUT_S)
    assert _leftovers(run_id)
    removed = netns.sweep_stale()
    assert f"{PREFIX}{run_id}-r0" in removed and f"{PREFIX}{run_id}-sw" in removed
    assert _leftovers(run_id) == []
    # This process's own network is alive and untouched.
    assert net.netns(0) in _netns_names()
    assert not [n for n in removed if n.startswith(f"{PREFIX}{net.run_id}-")]


# Inside rank 1: a paced sender (~8 MB/s, bounded by the script's ~3 s life) that reports
# how the TCP probe classifies its connection before and after the parent applies a fault.
SENDER = """
import os, socket, sys, threading, time
from ccld_plugin.probes.tcp_probe import TcpProbe
from ccld_plugin.probes.tcp_wait import classify_wait
probe = TcpProbe(sys.argv[3])
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
c.settimeout(0.2)
ino = os.fstat(c.fileno()).st_ino
stop = threading.Event()

def pump():
    buf = b"q" * 65536
    while not stop.is_set():
        try:
            c.send(buf)
        except TimeoutError:
            continue
        except OSError:
            return
        time.sleep(0.008)

def interval():
    conn = lambda: next(x for x in probe.sample() if x.inode == ino)
    a = conn()
    time.sleep(0.5)
    return classify_wait(a, conn())

threading.Thread(target=pump, daemon=True).start()
time.sleep(0.5)
print("before", interval(), flush=True)
sys.stdin.readline()
time.sleep(0.5)
print("after", interval(), interval(), flush=True)
stop.set()
"""


@pytest.fixture(scope="module")
def probe_lib(probe_library: tuple[Path, str]) -> Path:
    return probe_library[0]


@pytest.mark.parametrize("fault", ["shape", "cut"])
def test_probe_reads_a_faulted_link_as_network(
    net: ClosedNetwork, probe_lib: Path, fault: str
) -> None:
    server = start_server(net, 0)
    argv = [*net.exec_prefix(1), sys.executable, "-c", SENDER, net.address(0), str(PORT),
            str(probe_lib)]  # fmt: skip
    sender = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = sender.stdout.readline().split()  # type: ignore[union-attr]
        if fault == "shape":
            net.shape(1, "20mbit")
        else:
            net.cut(1)
        sender.stdin.write("go\n")  # type: ignore[union-attr]
        sender.stdin.flush()  # type: ignore[union-attr]
        after = sender.stdout.readline().split()  # type: ignore[union-attr]
        sender.wait(timeout=TIMEOUT_S)
    finally:
        if fault == "shape":
            net.unshape(1)
        else:
            net.restore(1)
        for p in (sender, server):
            p.kill()
            p.wait(timeout=TIMEOUT_S)
    assert before == ["before", "none"]
    # Shaped: a queue builds and the RTT rises far above its floor. Cut: bytes in flight
    # that nothing acknowledges, and retransmission timeouts.
    assert after == ["after", "network", "network"]
