"""What the start-up hook (``ccld_autoload.pth`` -> ``_ccld_autoload``) costs a Python
process that uses neither DeepSpeed nor Megatron.

Two arms, interleaved (with, without, with, ...): the environment as installed, and the same
with the hook's ``.pth`` file renamed away (put back at the end, however the run ends).
Reported: the median of each arm and the median of the paired differences, for the wall
time and the CPU time (user + sys of the child, from wait4) of ``python -c pass`` and of
``python -c "import torch"``. A whole process's time moves by more than the hook costs, so
the hook's own share of ``import torch`` is also counted directly: the finder is asked
about every module imported (``find_spec`` calls during ``import torch``) times what one
call for a module it does not watch costs (timeit).

    python benchmarks/startup_hook.py --python /path/to/venv/bin/python [--pairs 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

COUNT_CALLS = """
import _ccld_autoload, sys
finder, calls = _ccld_autoload._finder, [0]
find = finder.find_spec
def counted(*args, **kwargs):
    calls[0] += 1
    return find(*args, **kwargs)
finder.find_spec = counted
import torch
print(calls[0])
"""

PER_CALL = """
import timeit, _ccld_autoload
n = 1_000_000
t = timeit.timeit(lambda: _ccld_autoload._finder.find_spec("torch._some.module"), number=n)
e = timeit.timeit(lambda: None, number=n)
print((t - e) / n * 1e9)
"""


def _run(python: str, code: str) -> tuple[float, float]:
    """Wall and CPU seconds of one process running ``code``."""
    start = time.perf_counter()
    proc = subprocess.Popen([python, "-c", code], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait
    if proc.returncode != 0:
        raise SystemExit(f"{python} -c {code!r} exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def _site_pth(python: str) -> Path:
    out = subprocess.run(
        [
            python,
            "-c",
            "import _ccld_autoload, os; print(os.path.dirname(_ccld_autoload.__file__))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip()) / "ccld_autoload.pth"


def paired(python: str, code: str, pairs: int, pth: Path) -> dict[str, float]:
    off = pth.with_name(pth.name + ".off")
    on_wall, off_wall, on_cpu, off_cpu = [], [], [], []
    try:
        for _ in range(pairs):
            w, c = _run(python, code)
            on_wall.append(w)
            on_cpu.append(c)
            pth.rename(off)
            try:
                w, c = _run(python, code)
            finally:
                off.rename(pth)
            off_wall.append(w)
            off_cpu.append(c)
    finally:
        if off.exists():
            off.rename(pth)
    ms = 1e3

    def diff(a: list[float], b: list[float]) -> float:
        return statistics.median(x - y for x, y in zip(a, b, strict=True)) * ms

    return {
        "wall_with_ms": statistics.median(on_wall) * ms,
        "wall_without_ms": statistics.median(off_wall) * ms,
        "wall_diff_ms": diff(on_wall, off_wall),
        "cpu_with_ms": statistics.median(on_cpu) * ms,
        "cpu_without_ms": statistics.median(off_cpu) * ms,
        "cpu_diff_ms": diff(on_cpu, off_cpu),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", required=True, help="the interpreter of an environment with ccld")
    p.add_argument("--pairs", type=int, default=100, help="pairs for python -c pass")
    p.add_argument("--torch-pairs", type=int, default=20, help="pairs for import torch")
    args = p.parse_args()
    pth = _site_pth(args.python)
    os.environ.pop("CCLD_AUTOLOAD", None)  # the hook as installed
    for name, code, pairs in (
        ("python -c pass", "pass", args.pairs),
        ("python -c 'import torch'", "import torch", args.torch_pairs),
    ):
        r = paired(args.python, code, pairs, pth)
        print(
            f"{name} ({pairs} pairs): wall {r['wall_with_ms']:.2f} vs {r['wall_without_ms']:.2f} "
            f"ms, paired diff {r['wall_diff_ms']:+.2f} ms; CPU {r['cpu_with_ms']:.2f} vs "
            f"{r['cpu_without_ms']:.2f} ms, paired diff {r['cpu_diff_ms']:+.2f} ms"
        )
    calls = int(subprocess.run([args.python, "-c", COUNT_CALLS], capture_output=True,
                               text=True, check=True).stdout.split()[-1])  # fmt: skip
    ns = float(subprocess.run([args.python, "-c", PER_CALL], capture_output=True, text=True,
                              check=True).stdout.split()[-1])  # fmt: skip
    print(
        f"import torch asks the hook's finder {calls} times, {ns:.0f} ns a call: "
        f"{calls * ns / 1e6:.2f} ms"
    )


if __name__ == "__main__":
    main()
