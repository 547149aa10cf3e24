"""A closed-box network for communication faults: one namespace per rank.

Layout of a run with id RID (1-5 of [0-9a-z]) and N ranks::

    ccld-RID-sw   the "switch": a bridge ccld-RID-br and one port ccld-RID-pK per rank
    ccld-RID-rK   rank K: lo, and eth0 (the other end of ccld-RID-pK) at 10.213.X.(K+1)/24

The veth pairs are created from inside the switch namespace with their rank end moved
straight into the rank namespace, so no interface of the run ever exists in the host
namespace. The host gets no address in the subnet, no route, no NAT, no forwarding; the
rank namespaces have only their connected /24 and no default route. Every packet stays
between the run's namespaces.

Faults act on a rank's link: :meth:`ClosedNetwork.shape` puts a tbf on both ends of its
veth (rank egress and switch egress, so both directions are slow); :meth:`ClosedNetwork.cut`
takes the switch port down, which drops carrier on the rank's eth0 too, so nothing passes
either way while the rank keeps its address and routes, as with a pulled cable.

A run always removes what it created: on ``with`` exit, at interpreter exit, and on
SIGTERM / SIGINT. A run that was SIGKILLed leaves a state file under /run/ccld-netns/
naming its pid; :func:`sweep_stale` (also called when a network opens) removes the
namespaces of runs whose owner is dead.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import threading
import time
import warnings
from pathlib import Path
from types import FrameType, TracebackType

__all__ = [
    "PREFIX",
    "RANK_IFNAME",
    "STATE_DIR",
    "ClosedNetwork",
    "NetnsError",
    "available",
    "sweep_stale",
]

PREFIX = "ccld-"
RANK_IFNAME = "eth0"  # what a rank sees; GLOO_SOCKET_IFNAME=eth0 picks it
STATE_DIR = Path("/run/ccld-netns")
MAX_RANKS = 253  # .1 to .253 of one /24
COMMAND_TIMEOUT_S = 10.0
# What a rank left behind in its namespace (the W&B writer finishing its run, with
# ``ccld trace``) gets this long to end by itself before the namespace goes.
LEFTOVER_GRACE_S = 20.0
LINK_WAIT_S = 3.0  # carrier changes go through the kernel's linkwatch, up to ~1 s late

# Run ids are short because interface names have 15 characters: "ccld-" + 5 + "-p" + 3.
_RUN_ID = re.compile(r"^[0-9a-z]{1,5}$")
_NETNS_NAME = re.compile(r"^ccld-([0-9a-z]{1,5})-(sw|r\d{1,3})$")
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")


class NetnsError(RuntimeError):
    """An ``ip`` / ``tc`` command failed; the message is one line and names the command."""


def _run(argv: list[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
    cmd = shlex.join(argv)
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise NetnsError(f"`{cmd}` failed: {argv[0]} not found") from e
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`{cmd}` timed out after {timeout:g} s") from e
    if p.returncode != 0:
        why = " | ".join(ln.strip() for ln in p.stderr.splitlines() if ln.strip())
        raise NetnsError(f"`{cmd}` failed (exit {p.returncode}): {why or 'no message'}")
    return p.stdout


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _tc(*args: str) -> str:
    return _run(["tc", *args])


def _list_netns() -> list[str]:
    # Lines look like "name" or "name (id: 3)".
    return [ln.split()[0] for ln in _ip("netns", "list").splitlines() if ln.strip()]


# --- owners and state files ----------------------------------------------------------------


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after it.
    return int(stat.rpartition(")")[2].split()[19])


def _owner_alive(state: dict) -> bool:
    pid = int(state.get("pid", 0))
    return pid > 0 and _start_time(pid) == state.get("start_time")


def _state_path(run_id: str) -> Path:
    return STATE_DIR / f"{run_id}.json"


def _read_state(run_id: str) -> dict | None:
    try:
        return json.loads(_state_path(run_id).read_text())
    except (OSError, ValueError):
        return None


def _pids_inside(netns: str) -> list[str]:
    with contextlib.suppress(NetnsError):
        return _ip("netns", "pids", netns).split()
    return []


def _let_leftovers_end(names: list[str], timeout_s: float) -> None:
    """Wait until nothing runs in ``names`` any more, or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(_pids_inside(n) for n in names) and time.monotonic() < deadline:
        time.sleep(0.2)


def _kill_inside(netns: str) -> None:
    """SIGKILL what still runs inside one of our namespaces: only a run's own ranks can be
    there, and they would keep the namespace (and its network) alive after deletion."""
    for pid in _pids_inside(netns):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def sweep_stale() -> list[str]:
    """Remove namespaces left by runs whose owner process is dead; returns their names.

    Only names with our prefix, and only runs whose state file names a dead owner (a
    missing state file means the owner is unknown, so the namespace is left alone).
    """
    by_run: dict[str, list[str]] = {}
    for name in _list_netns():
        m = _NETNS_NAME.match(name)
        if m:
            by_run.setdefault(m.group(1), []).append(name)
    runs = set(by_run)
    if STATE_DIR.is_dir():
        runs |= {p.stem for p in STATE_DIR.glob("*.json") if _RUN_ID.match(p.stem)}
    removed = []
    for run_id in sorted(runs):
        state = _read_state(run_id)
        if state is None or _owner_alive(state):
            continue
        # Rank namespaces first: deleting them destroys their veths, then the switch.
        for name in sorted(by_run.get(run_id, []), key=lambda n: n.endswith("-sw")):
            _kill_inside(name)
            with contextlib.suppress(NetnsError):
                _ip("netns", "del", name)
                removed.append(name)
        if not set(by_run.get(run_id, [])) - set(removed):
            _state_path(run_id).unlink(missing_ok=True)
    return removed


# --- teardown on every exit path ------------------------------------------------------------

_open_networks: dict[int, ClosedNetwork] = {}
_registry_lock = threading.Lock()
_hooks_installed = False


def _close_all() -> None:
    with _registry_lock:
        nets = list(_open_networks.values())
    for net in nets:
        with contextlib.suppress(Exception):  # exit paths: remove as much as possible
            net.close()


def _on_signal(signum: int, frame: FrameType | None, previous: object) -> None:
    _close_all()
    if callable(previous):  # e.g. Python's SIGINT handler: KeyboardInterrupt as before
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        # The default action (terminate): restore it and die by the same signal, so that
        # the parent sees what it would have seen without us.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_exit_hooks() -> None:
    global _hooks_installed
    with _registry_lock:
        if _hooks_installed:
            return
        _hooks_installed = True
    atexit.register(_close_all)
    # Signal handlers can only be set from the main thread; elsewhere atexit must do.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            signal.signal(sig, functools.partial(_on_signal, previous=previous))


# --- the network ------------------------------------------------------------------------------


def _host_prefixes() -> list[ipaddress.IPv4Network]:
    """IPv4 prefixes the host namespace has addresses or routes in (default route aside)."""
    nets = []
    for iface in json.loads(_ip("-j", "-4", "addr", "show") or "[]"):
        for a in iface.get("addr_info", []):
            nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for r in json.loads(_ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = r.get("dst", "default")
        if dst != "default":
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.IPv4Network(dst, strict=False))
    return nets


def _pick_subnet(run_id: str) -> ipaddress.IPv4Network:
    """10.213.X.0/24 with X from the run id, moved on past anything the host uses (so the
    host could not reach the box even by accident, and our test of that means something)."""
    start = hashlib.sha256(run_id.encode()).digest()[0]
    taken = _host_prefixes()
    for i in range(256):
        net = ipaddress.IPv4Network(f"10.213.{(start + i) % 256}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise NetnsError("no free 10.213.X.0/24 subnet: the host uses all of 10.213.0.0/16")


class ClosedNetwork:
    """N rank namespaces on a bridge in a switch namespace; see the module docstring.

    Use as a context manager (or call :meth:`open` and :meth:`close`). Ranks are started
    with ``[*net.exec_prefix(rank), ...]`` and talk to each other at ``net.address(k)``.
    """

    def __init__(
        self,
        num_ranks: int,
        run_id: str | None = None,
        *,
        sweep: bool = True,
        kill_leftovers: bool = True,
    ) -> None:
        if not 1 <= num_ranks <= MAX_RANKS:
            raise ValueError(f"num_ranks must be in 1..{MAX_RANKS}, got {num_ranks}")
        if run_id is not None and not _RUN_ID.match(run_id):
            raise ValueError(f"run_id must be 1-5 characters of [0-9a-z], got {run_id!r}")
        self.num_ranks = num_ranks
        self.run_id = run_id or ""
        self.subnet: ipaddress.IPv4Network | None = None
        self._sweep = sweep
        self._kill_leftovers = kill_leftovers
        self._owner = os.getpid()  # only this process tears down (not forked children)
        self._created: list[str] = []  # namespaces, in creation order
        self._shaped: set[int] = set()
        self._closed = False

    # --- names ---

    @property
    def switch_netns(self) -> str:
        return f"{PREFIX}{self.run_id}-sw"

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.run_id}-br"

    def netns(self, rank: int) -> str:
        """The namespace of `rank`."""
        self._check_rank(rank)
        return f"{PREFIX}{self.run_id}-r{rank}"

    def switch_port(self, rank: int) -> str:
        """The switch-side end of `rank`'s veth (inside the switch namespace)."""
        self._check_rank(rank)
        return f"{PREFIX}{self.run_id}-p{rank}"

    def address(self, rank: int) -> str:
        """The IPv4 address of `rank`'s eth0."""
        self._check_rank(rank)
        if self.subnet is None:
            raise RuntimeError("network is not open")
        return str(self.subnet.network_address + rank + 1)

    def exec_prefix(self, rank: int) -> list[str]:
        """Prepend to a command to run it inside `rank`'s namespace."""
        return ["ip", "netns", "exec", self.netns(rank)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} not in 0..{self.num_ranks - 1}")

    # --- lifecycle ---

    def __enter__(self) -> ClosedNetwork:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except NetnsError as e:
            if exc is None:
                raise
            warnings.warn(f"closed network teardown: {e}", RuntimeWarning, stacklevel=2)

    def open(self) -> ClosedNetwork:
        """Create the namespaces, the bridge and the links. Idempotent."""
        if self._closed:
            raise RuntimeError("a closed network cannot be reopened; make a new one")
        if self._created:
            return self
        self._owner = os.getpid()
        if self._sweep:
            sweep_stale()
        self._claim_run_id()
        _install_exit_hooks()
        with _registry_lock:
            _open_networks[id(self)] = self
        try:
            self._build()
        except BaseException:
            with contextlib.suppress(Exception):
                self.close()
            raise
        return self

    def _claim_run_id(self) -> None:
        """Pick (or check) the run id and write the state file before creating anything,
        so that a crash at any later point leaves something sweep_stale can act on."""
        existing = set(_list_netns())
        fixed = bool(self.run_id)
        for _ in range(16):
            run_id = self.run_id or secrets.token_hex(2)
            clash = any(n.startswith(f"{PREFIX}{run_id}-") for n in existing)
            if not clash and _read_state(run_id) is None:
                break
            if fixed:
                raise NetnsError(f"run id {run_id!r} is in use (namespaces or state file)")
        else:
            raise NetnsError("could not find a free run id")
        self.run_id = run_id
        self.subnet = _pick_subnet(run_id)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {
            "pid": self._owner,
            "start_time": _start_time(self._owner),
            "subnet": str(self.subnet),
            "num_ranks": self.num_ranks,
        }
        tmp = _state_path(run_id).with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(_state_path(run_id))

    def _build(self) -> None:
        sw = self.switch_netns
        self._add_netns(sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        # STP stays off (the default): a port forwards as soon as it is up.
        _ip("-n", sw, "link", "add", self.bridge, "type", "bridge")
        _ip("-n", sw, "link", "set", self.bridge, "up")
        prefix_len = self.subnet.prefixlen  # type: ignore[union-attr]
        for rank in range(self.num_ranks):
            ns, port = self.netns(rank), self.switch_port(rank)
            self._add_netns(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Made inside the switch, the rank's end born straight into the rank's namespace.
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", RANK_IFNAME,
                "netns", ns)  # fmt: skip
            _ip("-n", sw, "link", "set", port, "master", self.bridge)
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(rank)}/{prefix_len}", "dev", RANK_IFNAME)
            _ip("-n", ns, "link", "set", RANK_IFNAME, "up")

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def close(self) -> None:
        """Remove everything this run created. Idempotent; a no-op in forked children."""
        if self._closed or os.getpid() != self._owner:
            return
        failures = []
        if self._kill_leftovers:
            _let_leftovers_end(self._created, LEFTOVER_GRACE_S)
        # Ranks first (their veths go with them), the switch last.
        for name in sorted(self._created, key=lambda n: n == self.switch_netns):
            if self._kill_leftovers:
                _kill_inside(name)
            try:
                _ip("netns", "del", name)
            except NetnsError as e:
                if name in _list_netns():
                    failures.append(str(e))
        self._created.clear()
        with _registry_lock:
            _open_networks.pop(id(self), None)
        self._closed = True
        if self.run_id and not failures:
            _state_path(self.run_id).unlink(missing_ok=True)
        if failures:
            raise NetnsError("; ".join(failures))

    # --- faults ---

    def shape(
        self, rank: int, rate: str = "20mbit", *, burst: str = "32kb", latency_ms: int = 50
    ) -> None:
        """Limit `rank`'s link to `rate` in both directions (tbf on both veth ends).

        `burst` must hold at least one MTU; `latency_ms` bounds the queue tbf keeps, which
        is what raises the RTT that the TCP probe reads as "network".
        """
        if not _RATE.match(rate):
            raise ValueError(f"rate must look like 20mbit (bit/kbit/mbit/gbit), got {rate!r}")
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", f"{latency_ms}ms"]
        self._require_open()
        _tc("-n", self.netns(rank), "qdisc", "replace", "dev", RANK_IFNAME, *tbf)
        _tc("-n", self.switch_netns, "qdisc", "replace", "dev", self.switch_port(rank), *tbf)
        self._shaped.add(rank)

    def unshape(self, rank: int) -> None:
        """Remove the rate limit of `rank`; a no-op if it has none."""
        self._require_open()
        if rank not in self._shaped:
            return
        _tc("-n", self.netns(rank), "qdisc", "del", "dev", RANK_IFNAME, "root")
        _tc("-n", self.switch_netns, "qdisc", "del", "dev", self.switch_port(rank), "root")
        self._shaped.discard(rank)

    def cut(self, rank: int) -> None:
        """Cut `rank`'s link: its switch port goes down and its eth0 loses carrier.

        Packets either way are dropped, silently, like a pulled cable: established
        connections stall (a communication hang) instead of failing fast.
        """
        self._require_open()
        _ip("-n", self.switch_netns, "link", "set", self.switch_port(rank), "down")

    def restore(self, rank: int) -> None:
        """Undo :meth:`cut`; returns once the rank's eth0 has carrier again."""
        self._require_open()
        _ip("-n", self.switch_netns, "link", "set", self.switch_port(rank), "up")
        deadline = time.monotonic() + LINK_WAIT_S
        while time.monotonic() < deadline:
            out = _ip("-n", self.netns(rank), "-j", "link", "show", RANK_IFNAME)
            if "LOWER_UP" in json.loads(out)[0].get("flags", []):
                return
            time.sleep(0.02)
        raise NetnsError(
            f"{self.netns(rank)}: {RANK_IFNAME} has no carrier {LINK_WAIT_S:g} s after restore"
        )

    def _require_open(self) -> None:
        if not self._created or self._closed:
            raise RuntimeError("network is not open")


@functools.cache
def available() -> tuple[bool, str]:
    """Whether closed networks work here, and why not: root, iproute2 and namespaces with
    bridge, veth and tbf are all needed. Tries a one-rank network once per process."""
    if not Path("/proc/self/ns/net").exists():
        return False, "no network namespaces (/proc/self/ns/net missing)"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    try:
        with ClosedNetwork(1) as net:
            net.shape(0, "100mbit")
            net.unshape(0)
    except (NetnsError, OSError) as e:
        return False, f"closed network does not work here: {e}"
    return True, "ok"
