"""Cost of one TCP probe sample with 8, 64 and 512 open loopback connections.

Each connection is a client/server pair of sockets in this process, so N connections are
2N sampled sockets. Prints the median microseconds per call of each layer:

  fd scan     reading /proc/self/fd (what every sample starts with)
  dump        ccld_tcp_sample: fd scan + full sock_diag dump (discovery)
  refresh     ccld_tcp_refresh: exact lookups of the known sockets
  sample_raw  TcpProbe.sample_raw() in steady state: fd scan + refresh + unpack
  sample      TcpProbe.sample() in steady state: the above + TcpConn objects

Usage: python benchmarks/tcp_probe_cost.py [--library PATH] [--counts 8 64 512]
Without --library it uses the library installed in the package, or compiles one with gcc
into a temporary directory.
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ccld_plugin.probes import tcp_probe as transport  # noqa: E402

MAX_CONNECTIONS = 4096  # keeps the fd count and the kernel's work bounded


def build_library(out_dir: Path) -> Path:
    csrc = ROOT / "ccld_plugin" / "csrc"
    lib = out_dir / "libnccl-profiler-ccld.so"
    cmd = [
        "gcc",
        "-shared",
        "-fPIC",
        "-O2",
        str(csrc / "board.c"),
        str(csrc / "tcp_probe.c"),
        "-o",
        str(lib),
    ]
    subprocess.run(cmd, check=True)
    return lib


def open_pairs(n: int) -> list[socket.socket]:
    if n > MAX_CONNECTIONS:
        raise ValueError(f"at most {MAX_CONNECTIONS} connections")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * n + 64
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    listener = socket.create_server(("127.0.0.1", 0), backlog=n)
    socks = []
    try:
        for _ in range(n):
            c = socket.create_connection(listener.getsockname(), timeout=5)
            s, _ = listener.accept()
            c.sendall(b"x" * 100)  # some traffic, so that the counters are not all zero
            s.recv(100)
            socks += [c, s]
    finally:
        listener.close()
    return socks


def median_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(min(reps, 10)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def measure(probe: transport.TcpProbe, n: int, reps: int) -> dict[str, float]:
    socks = open_pairs(n)
    try:
        lib = probe._lib
        cap = 2 * n + 64
        buf = ctypes.create_string_buffer(cap * transport._RECORD.size)
        found = lib.ccld_tcp_sample(None, 0, 0, buf, cap)
        if found != 2 * n:
            raise RuntimeError(f"probe saw {found} sockets, expected {2 * n}")
        refresh_buf = ctypes.create_string_buffer(buf.raw)  # refresh rewrites in place
        probe.sample_raw()  # fill the cache: later calls refresh
        row = {
            "fd scan": median_us(probe.socket_inodes, reps),
            "dump": median_us(lambda: lib.ccld_tcp_sample(None, 0, 0, buf, cap), reps),
            "refresh": median_us(lambda: lib.ccld_tcp_refresh(refresh_buf, found), reps),
            "sample_raw": median_us(probe.sample_raw, reps),
            "sample": median_us(probe.sample, reps),
        }
        if len(probe.sample()) != 2 * n:
            raise RuntimeError("steady-state sample lost sockets")
        return row
    finally:
        for s in socks:
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--library", type=Path)
    ap.add_argument("--counts", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        lib = args.library
        if lib is None:
            try:
                lib = transport.find_library()
            except FileNotFoundError:
                lib = build_library(Path(tmp))
        probe = transport.TcpProbe(lib)
        cols = ["fd scan", "dump", "refresh", "sample_raw", "sample"]
        print(f"library: {lib}")
        print(f"{'connections':>11} {'sockets':>7} " + " ".join(f"{c:>11}" for c in cols))
        for n in args.counts:
            row = measure(probe, n, args.reps)
            cells = " ".join(f"{row[c]:>9.1f}us" for c in cols)
            print(f"{n:>11} {2 * n:>7} {cells}")


if __name__ == "__main__":
    main()
