"""Issue every traced op type on a 4-rank job and print this rank's board records."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

sys.path.insert(0, str(Path(__file__).parent))
import captured_refs  # noqa: E402  - captures originals before the plugin is enabled

import ccld_plugin  # noqa: E402
from ccld_plugin.board.reader import BoardReader  # noqa: E402
from ccld_plugin.tracing.tracer import WRAPPED_NAMES  # noqa: E402
from ccld_plugin.wire.codes import OP_NAMES

originals = {n: getattr(c10d, n) for n in WRAPPED_NAMES if hasattr(c10d, n)}
functional = {n: getattr(torch.ops._c10d_functional, n) for n in ("all_reduce", "wait_tensor")}
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
session = ccld_plugin.enable(
    overrides=[f"board.dir={os.environ['BOARD_DIR']}", "job=j", "board.cleanup=false"]
)
pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
ccld_plugin.register_group(pair, "tp")
peer = rank ^ 1
t = torch.arange(4, dtype=torch.float32) + rank

dist.all_reduce(t)
dist.all_reduce(t, group=pair)
dist.all_gather([torch.zeros(4) for _ in range(world)], t)
dist.all_gather_into_tensor(torch.zeros(4 * world), t)
dist.reduce_scatter(
    torch.zeros(4), [torch.ones(4) for _ in range(world)]
) if dist.get_backend() != "gloo" else None
dist.reduce_scatter_tensor(
    torch.zeros(2), torch.ones(4), group=pair
) if dist.get_backend() != "gloo" else None
dist.broadcast(t, src=0)
dist.reduce(t, dst=0)
dist.all_to_all_single(torch.zeros(4 * world), torch.ones(4 * world))
dist.barrier()
dist.gather(t, [torch.zeros(4) for _ in range(world)] if rank == 0 else None, dst=0)
dist.scatter(t, [torch.ones(4) for _ in range(world)] if rank == 0 else None, src=0)
w = dist.all_reduce(t, async_op=True)
w.wait()
if rank % 2 == 0:
    dist.send(t, peer)
    dist.recv(t, peer)
else:
    dist.recv(t, peer)
    dist.send(t, peer)
req = dist.isend(t, peer) if rank % 2 == 0 else dist.irecv(t, peer)
req.wait()
reqs = dist.batch_isend_irecv(
    [dist.P2POp(dist.isend, t.clone(), peer), dist.P2POp(dist.irecv, torch.zeros(4), peer)]
)
for r in reqs:
    r.wait()
with c10d._coalescing_manager(group=pair):
    dist.all_reduce(torch.ones(3), group=pair)
    dist.all_reduce(torch.ones(5), group=pair)
# Functional collectives (DTensor's): from the call to the wait on the result, or until
# the result is freed unwaited (the second).
import torch.distributed._functional_collectives as funcol  # noqa: E402

funcol.all_reduce(t, "sum", pair).wait()
funcol.all_gather_tensor(t, 0, pair)  # its result dropped, never used
funcol.all_reduce(t, "sum", pair).wait()
# Through references captured at import, before enable: still traced.
out = torch.zeros(8)
captured_refs.gather(out, torch.ones(4), group=pair)
dist.barrier()

reader = BoardReader(session.board_path)
groups = {g.group_id: g for g in reader.groups()}
records = [
    {
        "op": OP_NAMES[int(r["op"])],
        "group": list(groups[int(r["group_id"])].ranks),
        "role": groups[int(r["group_id"])].role,
        "seq": int(r["seq"]),
        "peer": int(r["peer"]),
        "flags": int(r["flags"]),
        "bytes": int(r["bytes"]),
        "state": int(r["state"]),
        "dur_ns": int(r["exit_ns"] - r["enter_ns"]),
    }
    for r in reader.ops()
]
print("OPS " + json.dumps(records), flush=True)
ccld_plugin.disable()
restored = all(getattr(c10d, n) is o and getattr(dist, n, o) is o for n, o in originals.items())
restored &= all(getattr(torch.ops._c10d_functional, n) is o for n, o in functional.items())
print(
    "RESTORED "
    + json.dumps(
        {
            "all": restored,
            "captured": captured_refs.dist_all_gather_func is originals["all_gather_into_tensor"],
        }
    ),
    flush=True,
)
dist.destroy_process_group()
