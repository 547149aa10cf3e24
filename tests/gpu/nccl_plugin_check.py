"""GPU check of the NCCL profiler plugin: a real NCCL loads it and its events reach the board.

Not part of ``make test`` (CI has no GPU). On a machine with one GPU and a CUDA build of
torch, from the repository root:

    python3 -m pip install --no-build-isolation --no-deps --target /tmp/ccld .
    PYTHONPATH=/tmp/ccld python3 tests/gpu/nccl_plugin_check.py OUT_DIR

(omegaconf and antlr4-python3-runtime must be importable; carry them as wheels where pip
cannot fetch.) One rank, world size 1, NCCL backend: ``nccl_profiler: true`` points
``NCCL_PROFILER_PLUGIN`` at our library before NCCL starts, then a few all-reduces on a
GPU tensor run through the tracer. It checks, and prints as one JSON line (also written
to OUT_DIR/nccl_plugin_check.json):

- NCCL loaded our plugin and initialized a communicator through it (``comms`` >= 1);
- the communicator is bound to the tracer's world group (the thread-local trace id set
  before the real collective reached the Coll start event on the same thread);
- every traced all-reduce was seen as traced by the plugin, none as untraced;
- nothing was dropped and no channel record is left on the board after the work is done;
- the NCCL version, torch version and the GPU.

With one rank NCCL raises no proxy or kernel-channel events (no peers); the channel
table's handling of those is covered by tests/test_nccl_profiler.py's interface harness.
Exit status 0 when every check holds.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

OPS = 5


class Stats(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "comms",
            "traced",
            "untraced",
            "trace_mismatch",
            "foreign_ops",
            "dropped",
            "no_board",
            "live_events",
            "live_channels",
        )
    ]


def main(out: Path) -> int:
    import ccld_plugin
    from ccld_plugin.board.reader import BoardReader
    from ccld_plugin.topology import group_id_of
    from ccld_plugin.tracing.nccl_env import nccl_plugin_path

    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    session = ccld_plugin.enable(
        overrides=[
            "nccl_profiler=true",
            f"board.dir={out / 'boards'}",
            "board.cleanup=false",
            "job=gpu-check",
            "sinks.console=false",
        ]
    )
    result: dict = {
        "env": os.environ.get("NCCL_PROFILER_PLUGIN"),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
    }
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(OPS):
        dist.all_reduce(x)
    torch.cuda.synchronize()

    lib = ctypes.CDLL(nccl_plugin_path())
    stats = Stats()
    lib.ccld_nccl_stats(ctypes.byref(stats))
    ids, groups = (ctypes.c_uint64 * 8)(), (ctypes.c_uint64 * 8)()
    n = lib.ccld_nccl_comms(ids, groups, 8)
    world_id = group_id_of([0])
    result["stats"] = {name: getattr(stats, name) for name, _ in Stats._fields_}
    result["comms"] = [[f"{ids[i]:016x}", f"{groups[i]:016x}"] for i in range(min(n, 8))]
    with BoardReader(session.board_path) as reader:
        ops = reader.ops()
        result["board_ops"] = int(len(ops))
        result["board_channels_left"] = int(len(reader.channels()))
    checks = {
        "plugin loaded by NCCL": result["env"] == nccl_plugin_path() and stats.comms >= 1,
        "comm bound to the world group": any(groups[i] == world_id for i in range(min(n, 8))),
        "every all-reduce traced": stats.traced >= OPS
        and stats.untraced == 0
        and stats.trace_mismatch == 0,
        "nothing dropped": stats.dropped == 0 and stats.no_board == 0,
        "no channel record left": result["board_channels_left"] == 0,
    }
    result["checks"] = checks
    result["ok"] = all(checks.values())
    line = json.dumps(result)
    print(line, flush=True)
    (out / "nccl_plugin_check.json").write_text(line + "\n")
    ccld_plugin.disable()
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ccld-gpu-check")))
