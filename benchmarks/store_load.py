"""Does torch's TCPStore hold the control-plane load of a large job?

Real ``torch.distributed.TCPStore`` clients on loopback, shaped like the control plane of a
job with one agent connection per node leader:

- the store runs in a child process, listening on 127.0.0.1 only (a socket bound there and
  handed over as ``master_listen_fd``: with a port alone TCPStore listens on every address);
- writer processes (``--workers``), each one thread looping over its share of the
  connections, open ranks / ranks-per-node connections between them; every connection
  writes one key ``ccld/node/<i>`` (a packed node summary, ranks-per-node x 900 bytes)
  once per interval, the connections' writes spread evenly over the interval;
- a reader (the diagnoser, in this process) reads every node key once per interval with
  ``multi_get`` in chunks of 512 keys.

A write is timed until the store has applied it: ``set`` is not acknowledged, so each set
is followed by a one-key ``check`` on the same connection, which the store answers after
the set. Per job size it prints the write latency, the writes per second achieved against
those wanted, the read round latency, the CPU share of the store's process (user + system
time from /proc over the measured window, in % of one core) and of the load generator, and
whether the store held: achieved >= 95% of wanted, no errors, write p99 below half the
interval and read p99 below the interval. The load generator shares the machine with the
store, so on a small machine the numbers are pessimistic. Each client's connect does a
reverse DNS lookup of its address (c10d's log lines); the children's resolver gives up
after 1 s (RES_OPTIONS, unless set), so a lossy DNS server slows the set-up only.

With ``--read-round``, it measures instead what the diagnoser's read of one round costs
through the real control plane (``ControlPlane.read_summaries``: existence check, chunked
``multi_get``, node frames split back into per-rank summaries) from a quiet store: one key
per rank (``--ranks-per-node 1``: each rank its own key) against one framed key per node.

Usage:
    python benchmarks/store_load.py [--ranks 16384 65536] [--ranks-per-node 8]
        [--interval-s 1.0] [--seconds 20] [--workers 4]
    python benchmarks/store_load.py --read-round [--ranks 16384] [--ranks-per-node 1 8]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch.distributed as dist

KEY = "ccld/node/{}"
BYTES_PER_RANK = 900  # a rank's share of a packed node summary
READ_CHUNK = 512  # keys per multi_get
FD_MARGIN = 256  # descriptors a process needs besides its connections
HOLD_SHARE = 0.95  # achieved / wanted writes for the store to have held
BUSY_STORE_CPU = 50.0  # % of a core: below it, a shortfall is more likely the machine's
START_LEAD_S = 1.0  # between sending the start time and the start
JOIN_S = 5.0  # grace for a child to exit before it is terminated
ADVICE = (
    "advice: run the job's store on a dedicated host, or use the launcher's store "
    "(torchrun's c10d rendezvous store) or an existing etcd-backed rendezvous: "
    "an existing store, not one we write."
)


@dataclass(frozen=True)
class Spec:
    """One measurement: the load and the limits it runs under."""

    port: int
    connections: int
    workers: int
    interval_s: float
    value_bytes: int
    timeout_s: float
    connect_timeout_s: float


@dataclass
class Writes:
    """What one writer process measured."""

    latencies: array
    errors: int
    first_error: str
    cpu_s: float


@dataclass
class Reads:
    """What the reader measured."""

    latencies: list[float]
    wanted: int
    errors: int
    first_error: str
    short_values: int


@dataclass
class Row:
    """One job size's line of the table."""

    ranks: int
    connections: int
    capped: bool
    setup_s: float = 0.0
    set_p50_ms: float = float("nan")
    set_p99_ms: float = float("nan")
    sets_per_s: float = 0.0
    wanted_per_s: float = 0.0
    read_p50_ms: float = float("nan")
    read_p99_ms: float = float("nan")
    store_cpu: float = float("nan")
    gen_cpu: float = float("nan")
    load: float = float("nan")
    failure: str = ""


# ------------------------------------------------------------------ store and clients
def host_store(conn: Connection) -> None:
    """Child process: host a TCPStore on 127.0.0.1 until told to stop (or the parent dies)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=socket.SOMAXCONN)
    port = listener.getsockname()[1]
    _store = dist.TCPStore(
        host_name="127.0.0.1",
        port=port,
        is_master=True,
        wait_for_workers=False,
        use_libuv=True,
        master_listen_fd=listener.detach(),
    )
    conn.send(port)
    try:
        conn.recv()
    except EOFError:
        pass


def client(spec: Spec) -> dist.TCPStore:
    """A new client connection to the store: the connect timeout, then the requests' one."""
    store = dist.TCPStore(
        host_name="127.0.0.1",
        port=spec.port,
        is_master=False,
        timeout=timedelta(seconds=spec.connect_timeout_s),
        wait_for_workers=False,
        use_libuv=True,
    )
    store.set_timeout(timedelta(seconds=spec.timeout_s))
    return store


# ------------------------------------------------------------------ writers
def write_nodes(index: int, spec: Spec, conn: Connection) -> None:
    """Writer process: open its connections, register its keys, then write on schedule."""
    ids = range(index, spec.connections, spec.workers)
    value = os.urandom(spec.value_bytes)
    try:
        stores = [client(spec) for _ in ids]
        for store, i in zip(stores, ids, strict=True):
            store.set(KEY.format(i), value)
    except (RuntimeError, OSError) as exc:
        conn.send(("error", f"writer {index}: {one_line(exc)}"))
        return
    conn.send(("ready", len(stores)))
    try:
        window = conn.recv()
    except EOFError:
        return
    if window is not None:
        conn.send(("done", write_schedule(stores, ids, value, spec, *window)))


def write_schedule(
    stores: list[dist.TCPStore], ids: range, value: bytes, spec: Spec, start: float, end: float
) -> Writes:
    """Each connection writes its key once per interval at its own phase until ``end``."""
    keys = [KEY.format(i) for i in ids]
    phases = [i / spec.connections * spec.interval_s for i in ids]
    out = Writes(array("d"), 0, "", 0.0)
    cpu0 = cpu_self()
    base = start
    while True:
        for store, key, phase in zip(stores, keys, phases, strict=True):
            if not wait_until(base + phase, end):
                out.cpu_s = cpu_self() - cpu0
                return out
            timed_write(store, key, value, out)
        base += spec.interval_s


def timed_write(store: dist.TCPStore, key: str, value: bytes, out: Writes) -> None:
    """Set ``key`` and wait until the store has applied it; record the latency or the error."""
    t0 = time.perf_counter()
    try:
        store.set(key, value)
        store.check([key])
    except RuntimeError as exc:
        out.errors += 1
        out.first_error = out.first_error or one_line(exc)
        return
    out.latencies.append(time.perf_counter() - t0)


def wait_until(due: float, end: float) -> bool:
    """Sleep until ``due`` (wall clock); False once ``due`` or now is past ``end``."""
    now = time.time()
    if due >= end or now >= end:
        return False
    if due > now:
        time.sleep(due - now)
    return True


# ------------------------------------------------------------------ reader
def read_rounds(store: dist.TCPStore, spec: Spec, start: float, end: float) -> Reads:
    """Read every node key once per interval, in chunks, until ``end``."""
    keys = [KEY.format(i) for i in range(spec.connections)]
    chunks = [keys[k : k + READ_CHUNK] for k in range(0, len(keys), READ_CHUNK)]
    out = Reads([], int((end - start) / spec.interval_s), 0, "", 0)
    base = start
    while wait_until(base, end):
        t0 = time.perf_counter()
        try:
            out.short_values += sum(read_chunk(store, c, spec.value_bytes) for c in chunks)
        except RuntimeError as exc:
            out.errors += 1
            out.first_error = out.first_error or one_line(exc)
        else:
            out.latencies.append(time.perf_counter() - t0)
        base += spec.interval_s
    return out


def read_chunk(store: dist.TCPStore, keys: list[str], value_bytes: int) -> int:
    """Read ``keys`` with one multi_get; return how many values came back short."""
    return sum(len(v) != value_bytes for v in store.multi_get(keys))


# ------------------------------------------------------------------ processes
class Fleet:
    """The store's process and the writers of one measurement, always stopped on exit."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[tuple[BaseProcess, Connection]] = []

    def spawn(self, target: Callable[..., None], *args: object) -> Connection:
        ours, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=target, args=(*args, theirs), daemon=True)
        proc.start()
        theirs.close()
        self.procs.append((proc, ours))
        return ours

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc, conn in self.procs:
            if proc.is_alive():
                send_if_open(conn, None)
        deadline = time.monotonic() + JOIN_S
        for proc, _ in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(JOIN_S)
        for _, conn in self.procs:
            conn.close()


def send_if_open(conn: Connection, msg: object) -> None:
    """Send ``msg`` unless the other end is gone."""
    try:
        conn.send(msg)
    except (BrokenPipeError, OSError):
        pass


def receive(conn: Connection, deadline: float, what: str) -> object:
    """The next message on ``conn`` before ``deadline`` (monotonic); raise on timeout/exit."""
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"no {what} within the time limit")
    try:
        return conn.recv()
    except EOFError:
        raise ConnectionError(f"{what}: the process exited") from None


# ------------------------------------------------------------------ one job size
def measure(ranks: int, connections: int, capped: bool, args: argparse.Namespace) -> Row:
    """Run one job size; a failure is reported in the row, never raised."""
    row = Row(ranks, connections, capped, wanted_per_s=connections / args.interval_s)
    try:
        with Fleet() as fleet:
            run_load(fleet, row, args)
    except (TimeoutError, ConnectionError, RuntimeError, OSError) as exc:
        row.failure = one_line(exc)
    return row


def run_load(fleet: Fleet, row: Row, args: argparse.Namespace) -> None:
    """Start the store and the writers, measure one window, fill ``row``."""
    t0 = time.monotonic()
    host = fleet.spawn(host_store)
    port = int(receive(host, t0 + args.setup_timeout_s, "store port"))
    spec = Spec(
        port,
        row.connections,
        min(args.workers, row.connections),
        args.interval_s,
        args.ranks_per_node * BYTES_PER_RANK,
        args.timeout_s,
        args.setup_timeout_s,
    )
    writers = [fleet.spawn(write_nodes, w, spec) for w in range(spec.workers)]
    for w in writers:
        kind, detail = receive(w, t0 + args.setup_timeout_s, "writer's connections")
        if kind == "error":
            raise ConnectionError(detail)
    row.setup_s = time.monotonic() - t0
    reader = client(spec)
    start = time.time() + START_LEAD_S
    end = start + args.seconds
    for w in writers:
        w.send((start, end))
    host_pid = fleet.procs[0][0].pid
    wait_until(start, end)
    cpu_host0, cpu_gen0 = cpu_of(host_pid), cpu_self()
    reads = read_rounds(reader, spec, start, end)
    row.store_cpu = (cpu_of(host_pid) - cpu_host0) / args.seconds * 100
    gen_cpu = cpu_self() - cpu_gen0
    row.load = os.getloadavg()[0]
    done_by = time.monotonic() + (end - time.time()) + args.timeout_s + JOIN_S
    writes = [receive(w, done_by, "writer's results")[1] for w in writers]
    fill_row(row, spec, args.seconds, writes, reads)
    row.gen_cpu = (gen_cpu + sum(w.cpu_s for w in writes)) / args.seconds * 100


def fill_row(row: Row, spec: Spec, seconds: float, writes: list[Writes], reads: Reads) -> None:
    """Latencies, rates and the first error of one window."""
    lat = sorted(x for w in writes for x in w.latencies)
    row.set_p50_ms, row.set_p99_ms = pct_ms(lat, 0.50), pct_ms(lat, 0.99)
    row.sets_per_s = len(lat) / seconds
    rounds = sorted(reads.latencies)
    row.read_p50_ms, row.read_p99_ms = pct_ms(rounds, 0.50), pct_ms(rounds, 0.99)
    errors = [(w.errors, w.first_error) for w in writes] + [(reads.errors, reads.first_error)]
    failed = [(n, e) for n, e in errors if n]
    if failed:
        row.failure = f"{sum(n for n, _ in failed)} errors, first: {failed[0][1]}"
    elif reads.short_values:
        row.failure = f"{reads.short_values} values read back short"
    elif len(rounds) < HOLD_SHARE * reads.wanted:
        row.failure = f"{len(rounds)} of {reads.wanted} read rounds"


def verdict(row: Row, interval_s: float) -> str:
    """Why the store did not hold at this size, or '' when it held."""
    if row.failure and not row.sets_per_s:
        return row.failure
    reasons = [row.failure] if row.failure else []
    if row.sets_per_s < HOLD_SHARE * row.wanted_per_s:
        reasons.append(f"writes {row.sets_per_s:.0f}/s of {row.wanted_per_s:.0f}/s wanted")
    if not row.set_p99_ms < interval_s * 500:
        reasons.append(f"write p99 {row.set_p99_ms:.1f} ms >= half the interval")
    if not row.read_p99_ms < interval_s * 1000:
        reasons.append(f"read round p99 {row.read_p99_ms:.1f} ms >= the interval")
    return "; ".join(dict.fromkeys(reasons))


# ------------------------------------------------------------------ limits and helpers
def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard limit; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft
    return hard


def ephemeral_ports() -> int:
    """How many local ports the kernel hands out to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        return 1 << 16
    return high - low + 1


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_self() -> float:
    """User + system CPU seconds of this process."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pct_ms(sorted_s: list[float], q: float) -> float:
    """The ``q`` quantile of sorted seconds, in ms (nan when empty)."""
    if not sorted_s:
        return float("nan")
    return sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1000


def one_line(exc: BaseException) -> str:
    """An exception as one short line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


# ------------------------------------------------------------------ output
HEADER = (
    f"{'ranks':>6} {'conns':>6} {'setup s':>7} {'set p50':>8} {'set p99':>8} "
    f"{'sets/s got/want':>16} {'read p50':>9} {'read p99':>9} {'store CPU':>9} "
    f"{'gen CPU':>8} {'load':>5}  held"
)


def format_row(row: Row, interval_s: float) -> str:
    """One line of the table; latencies in ms, CPU in % of one core."""
    why = verdict(row, interval_s)
    conns = f"{row.connections}{'*' if row.capped else ''}"
    rate = f"{row.sets_per_s:.0f}/{row.wanted_per_s:.0f}"
    held = "no (capped)" if row.capped and not why else ("no: " + why if why else "yes")
    return (
        f"{row.ranks:>6} {conns:>6} {row.setup_s:>7.1f} {row.set_p50_ms:>8.2f} "
        f"{row.set_p99_ms:>8.2f} {rate:>16} {row.read_p50_ms:>9.1f} {row.read_p99_ms:>9.1f} "
        f"{row.store_cpu:>8.0f}% {row.gen_cpu:>7.0f}% {row.load:>5.1f}  {held}"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--ranks-per-node", type=int, nargs="+", default=[8])
    p.add_argument(
        "--read-round",
        action="store_true",
        help="measure the diagnoser's read of a round through the control plane instead",
    )
    p.add_argument("--interval-s", type=float, default=1.0, help="agent write interval")
    p.add_argument("--seconds", type=float, default=20.0, help="measured time per size")
    p.add_argument("--workers", type=int, default=4, help="writer processes")
    p.add_argument("--timeout-s", type=float, default=10.0, help="store client timeout")
    p.add_argument("--setup-timeout-s", type=float, default=120.0)
    return p.parse_args()


def quiet_clients() -> None:
    """Environment of the children: c10d logs errors only (each size reports its first
    error in one line), and a client's reverse DNS lookup of its own address at connect
    (for c10d's log lines) gives up after 1 s instead of the resolver's 2 x 5 s."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


def read_round(ranks_list: list[int], per_node: list[int], rounds: int = 9) -> None:
    """The diagnoser's read of a round over the real control plane, per job size and node
    size: median and best of ``rounds`` reads, every rank's summary BYTES_PER_RANK bytes."""
    from ccld_plugin.config import ControlConfig
    from ccld_plugin.control import ControlPlane
    from ccld_plugin.wire.node_summary import encode_node, node_count, node_ranks

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    summary = b"\0" * BYTES_PER_RANK
    print(f"{'ranks':>7} {'per node':>8} {'keys':>6} {'read round ms':>13} {'best ms':>8}")
    for world in ranks_list:
        for size in per_node:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cfg = ControlConfig(store="dedicated", port=port, connect_timeout_s=60)
            job = ControlPlane(cfg, 0, world, "bench", 0, ranks_per_node=size)
            for n in range(node_count(world, size)):
                if size == 1:
                    job.publish(n, summary)  # a rank alone on its node: its own key
                else:
                    frame = encode_node((r, summary) for r in node_ranks(n, size, world))
                    job.publish_node(n, frame)
            reader = ControlPlane.client(cfg, "127.0.0.1", port, "bench", world)
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                got = reader.read_summaries(range(world))
                times.append(time.perf_counter() - t0)
            assert len(got) == world, f"read {len(got)} of {world} summaries"
            times.sort()
            print(
                f"{world:>7} {size:>8} {node_count(world, size):>6} "
                f"{times[len(times) // 2] * 1000:>13.1f} {times[0] * 1000:>8.1f}"
            )


def main() -> None:
    args = parse_args()
    quiet_clients()
    if args.read_round:
        read_round(args.ranks, args.ranks_per_node)
        return
    args.ranks_per_node = args.ranks_per_node[0]
    fd_limit, ports = raise_fd_limit(), ephemeral_ports()
    cap = min(fd_limit, ports) - FD_MARGIN
    limit = f"open-file limit {fd_limit}" if fd_limit <= ports else f"{ports} ephemeral ports"
    print(
        f"machine: {os.cpu_count()} CPUs (store, writers and reader share them); "
        f"open-file limit {fd_limit}, ephemeral ports {ports}; "
        f"{args.workers} writer processes, interval {args.interval_s:g} s, "
        f"{args.seconds:g} s per size, value {args.ranks_per_node * BYTES_PER_RANK} B"
    )
    rows = []
    for ranks in args.ranks:
        wanted = ranks // args.ranks_per_node
        if wanted > cap:
            print(f"{ranks} ranks: {wanted} connections exceed the {limit}; capped at {cap}")
        rows.append(measure(ranks, min(wanted, cap), wanted > cap, args))
    print_table(rows, args.interval_s)


def print_table(rows: list[Row], interval_s: float) -> None:
    """The table, then the sizes at which the store did not hold and what to do about it."""
    print(HEADER)
    for row in rows:
        print(format_row(row, interval_s))
    print(
        "(* capped; latencies in ms; CPU in % of one core over the measured window; "
        "load: the machine's 1-minute load average at its end)"
    )
    failed = [(row, why) for row in rows if (why := verdict(row, interval_s))]
    for row, why in failed:
        print(f"TCPStore did not hold at {row.ranks} ranks ({row.connections} connections): {why}")
        if row.store_cpu < BUSY_STORE_CPU:
            print(
                f"  note: its process used {row.store_cpu:.0f}% of one core, with load average "
                f"{row.load:.1f} on {os.cpu_count()} CPUs: the shortfall may be this machine's"
            )
    if failed:
        print(ADVICE)


if __name__ == "__main__":
    main()
