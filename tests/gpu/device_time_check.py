"""GPU check of the device timeline: built from this source tree, run on one GPU (or two).

Not part of ``make test`` (CI has no GPU), and not yet run on a GPU. It assumes a Linux
machine with a CUDA build of torch (2.11 or newer), its NCCL, a C/C++ compiler, and no
network. Two steps, from the repository root:

1. Beforehand, on a machine with network, the same Python minor version and platform as
   the GPU machine (or name them: ``--python-version 3.12 --platform
   manylinux_2_28_x86_64``), fetch the wheels the check needs and the GPU machine may lack
   (the package's runtime and build dependencies; torch is never fetched)::

       python3 tests/gpu/device_time_check.py fetch WHEELS_DIR

2. On the GPU machine, with WHEELS_DIR copied there::

       python3 tests/gpu/device_time_check.py run OUT_DIR --wheels WHEELS_DIR [--gpus 2]

   It builds the package from the source tree into OUT_DIR/site (pip, no index: the build
   dependencies and the runtime ones from WHEELS_DIR), then runs the checks in a child
   process with that on its path, and prints one JSON line (also OUT_DIR/device_time.json):
   the NCCL, CUDA, driver and torch versions, the GPU, each check, ``ok``. Exit 0 when
   every check holds. Under 5 minutes (the build is most of it).

Checks, one GPU (one rank, NCCL world of one):

- NCCL loads our profiler plugin (``nccl_profiler: true``) and binds its communicator;
- the device timeline is read without a sync: with the device busy 200 ms
  (``torch.cuda._sleep``), a traced all-reduce returns at once, and its board record says
  the device has not reached it yet; after the check's own ``synchronize`` it gets device
  times;
- the known delay shows at that op: the device time between the previous all-reduce's end
  and its start is the delay (measured alone with CUDA events) within 10 %;
- which source gave each op's times (with one rank NCCL raises no kernel-channel events:
  CUDA events then).

Two GPUs (``--gpus 2``): two ranks train a step of 4 device kernels and an all-reduce,
reading the loss each step; from step 20 rank 1's device runs each kernel twice (its host
is not slowed). The diagnoser (short thresholds) must name rank 1 a compute straggler.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME = ["numpy", "omegaconf", "PyYAML", "rich"]  # the package's, torch aside
BUILD = ["scikit-build-core", "nanobind", "ninja", "cmake"]
DELAY_MS = 200.0  # the known device delay
TOLERANCE = 0.10


# ------------------------------------------------------------------ fetch, build, run
def fetch(folder: Path, extra: list[str]) -> int:
    """Download wheels of the runtime and build dependencies (and theirs) into ``folder``."""
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(folder)]
    return subprocess.call([*cmd, *extra, *RUNTIME, *BUILD])


def build(out: Path, wheels: Path) -> Path:
    """The package built from the source tree into ``out/site`` with the wheels in
    ``wheels`` (no index), and its runtime dependencies beside it."""
    site = out / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels)]
    pip += ["--target", str(site), "--upgrade"]
    subprocess.run([*pip, "--no-deps", str(REPO)], check=True)  # build isolation, from wheels
    missing = [m for m in RUNTIME if not _importable(m)]
    if missing:
        subprocess.run([*pip, *missing], check=True)
    return site


def _importable(name: str) -> bool:
    module = {"PyYAML": "yaml"}.get(name, name)
    probe = [sys.executable, "-c", f"import {module}"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def run(out: Path, wheels: Path, gpus: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    site = build(out, wheels)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", TORCHDYNAMO_DISABLE="1")
    me = str(Path(__file__).resolve())
    if gpus == 1:
        code = subprocess.call([sys.executable, me, "one", str(out)], env=env, cwd=out)
    else:
        procs = [
            subprocess.Popen(
                [sys.executable, me, "rank", str(out)],
                env={**env, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)},
                cwd=out,
            )
            for r in range(2)
        ]
        codes = [p.wait(timeout=240) for p in procs]
        code = codes[0] or codes[1] or _judge_two(out)
    print(f"device_time_check: {time.monotonic() - started:.0f} s in all", file=sys.stderr)
    return code


# ------------------------------------------------------------------ on the GPU
def versions() -> dict:
    import torch

    driver = ctypes.c_int(0)
    try:
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(driver))
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "driver": f"{driver.value // 1000}.{driver.value % 1000 // 10}" if driver.value else None,
        "gpu": torch.cuda.get_device_name(),
    }


def _enable(out: Path, *extra: str) -> object:
    import ccld_plugin

    return ccld_plugin.enable(
        overrides=[
            "nccl_profiler=true",
            f"board.dir={out / 'boards'}",
            "board.cleanup=false",
            "job=gpu-device-time",
            "sinks.console=false",
            *extra,
        ]
    )


def _cycles_for(ms: float) -> int:
    """``torch.cuda._sleep`` cycles that take about ``ms`` on this GPU (measured)."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    return int(10_000_000 * ms / a.elapsed_time(b))


def _delay_ms(cycles: int) -> float:
    """The device time of ``_sleep(cycles)``, alone, between CUDA events."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _record(board: Path, index: int) -> dict:
    from ccld_plugin.board.reader import BoardReader

    with BoardReader(board) as reader:
        for o in reader.ops():
            if int(o["index_lo"]) == index & 0xFFFFFFFF:
                return {k: int(o[k]) for k in o.dtype.names if k != "lock"}
    return {}


def _ended(board: Path, index: int) -> dict:
    """The op's record once it has its device end, else {}."""
    rec = _record(board, index)
    return rec if rec.get("dev_end_ns") else {}


def _until(fn: Callable[[], dict], timeout_s: float = 10.0) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        time.sleep(0.01)
    return fn()


def one(out: Path) -> int:
    import torch
    import torch.distributed as dist

    from ccld_plugin.board.reader import BoardReader
    from ccld_plugin.tracing.nccl_env import nccl_plugin_path
    from ccld_plugin.wire.codes import FLAG_DEVICE, STATE_IN_FLIGHT, TIME_NAMES

    torch.cuda.set_device(0)
    session = _enable(out)
    dist.init_process_group("nccl", rank=0, world_size=1)
    lib = ctypes.CDLL(nccl_plugin_path())
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)  # the communicator starts
    torch.cuda.synchronize()
    cycles = _cycles_for(DELAY_MS)
    delay = _delay_ms(cycles)
    board = session.board_path  # type: ignore[attr-defined]
    dist.all_reduce(x)  # the op before the delay
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    call_ms = (time.perf_counter() - t0) * 1e3
    with BoardReader(board) as reader:
        index = reader.header().ops_written - 1
    at_once = _record(board, index)
    torch.cuda.synchronize()  # the check's own sync, after the host-side look
    after = _until(lambda: _ended(board, index))
    prev = _until(lambda: _ended(board, index - 1))
    gap_ms = (after["dev_start_ns"] - prev["dev_end_ns"]) / 1e6 if after and prev else -1.0
    stats = (ctypes.c_uint64 * 9)()
    lib.ccld_nccl_stats(stats)
    result = {
        **versions(),
        "delay_ms": round(delay, 3),
        "gap_ms": round(gap_ms, 3),
        "call_ms": round(call_ms, 3),
        "sources": {
            "start": TIME_NAMES.get(after.get("dev_source", 0) & 0xF),
            "end": TIME_NAMES.get(after.get("dev_source", 0) >> 4),
        },
        "plugin_comms": int(stats[0]),
    }
    result["checks"] = {
        "NCCL loaded the profiler plugin": os.environ.get("NCCL_PROFILER_PLUGIN")
        == nccl_plugin_path()
        and stats[0] >= 1,
        "the call returned without waiting for the device": call_ms < delay / 4,
        "the op was not reached when the call returned (no sync)": at_once.get("state")
        == STATE_IN_FLIGHT
        and bool(at_once.get("flags", 0) & FLAG_DEVICE)
        and at_once.get("dev_start_ns") == 0,
        f"the delay shows at the op within {TOLERANCE:.0%}": abs(gap_ms - delay)
        <= TOLERANCE * delay,
    }
    return _report(out, result)


def _report(out: Path, result: dict) -> int:
    import torch.distributed as dist

    import ccld_plugin

    result["ok"] = all(result["checks"].values())
    line = json.dumps(result)
    print(line, flush=True)
    (out / "device_time.json").write_text(line + "\n")
    ccld_plugin.disable()
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


def rank(out: Path) -> int:
    """One of two ranks: 4 kernels of ~10 ms and an all-reduce a step, the loss read each
    step; rank 1's device runs each kernel twice from step 20."""
    import torch
    import torch.distributed as dist

    import ccld_plugin

    me = int(os.environ["RANK"])
    torch.cuda.set_device(me)
    _enable(
        out,
        f"sinks.jsonl={out / 'verdicts.jsonl'}",
        "agent.interval_s=0.5",
        "diagnoser.hang_min_s=3",
    )
    dist.init_process_group("nccl")
    cycles = _cycles_for(10.0)
    x = torch.ones(1 << 16, device="cuda")
    for step in range(160):
        ccld_plugin.mark_step(step)
        for _ in range(4):
            torch.cuda._sleep(cycles)
            if me == 1 and step >= 20:
                torch.cuda._sleep(cycles)  # device-slow x2: the device's doing, not the host's
        dist.all_reduce(x)
        x.sum().item()  # the loss: a sync point
    if me == 0:
        (out / "versions.json").write_text(json.dumps(versions()))
    ccld_plugin.disable()
    dist.destroy_process_group()
    return 0


def _judge_two(out: Path) -> int:
    path = out / "verdicts.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    verdicts = [json.loads(x) for x in lines if x.strip()]
    slow = [v for v in verdicts if v["kind"] == "slow"]
    result = {
        **json.loads((out / "versions.json").read_text()),
        "verdicts": [(v["kind"], v["cause"], v["ranks"], v["group"]["role"]) for v in verdicts],
    }
    result["checks"] = {
        "rank 1 named a compute straggler": any(
            v["cause"] == "compute" and v["ranks"] == [1] for v in slow
        ),
        "no other verdict": len(verdicts) == len(slow) and all(v["ranks"] == [1] for v in slow),
    }
    result["ok"] = all(result["checks"].values())
    line = json.dumps(result)
    print(line, flush=True)
    (out / "device_time.json").write_text(line + "\n")
    return 0 if result["ok"] else 1


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download the wheels beforehand (needs network)")
    f.add_argument("folder", type=Path)
    f.add_argument("--python-version")
    f.add_argument("--platform")
    r = sub.add_parser("run", help="build from this tree and run the checks (on the GPU)")
    r.add_argument("out", type=Path)
    r.add_argument("--wheels", type=Path, required=True)
    r.add_argument("--gpus", type=int, choices=[1, 2], default=1)
    for child in ("one", "rank"):  # the checks themselves, started by run
        sub.add_parser(child).add_argument("out", type=Path)
    args = p.parse_args(argv)
    if args.command == "fetch":
        named = {"--python-version": args.python_version, "--platform": args.platform}
        return fetch(args.folder, [f"{k}={v}" for k, v in named.items() if v])
    if args.command == "run":
        return run(args.out.resolve(), args.wheels.resolve(), args.gpus)
    return one(args.out) if args.command == "one" else rank(args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
