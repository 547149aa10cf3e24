"""A gloo job on simulated nodes of 2 ranks (``control.ranks_per_node=2``) that looks at
the store from inside: rank 0 reads the keys the agents wrote and prints what it found.

    node_summaries.py OUT healthy   every rank trains; mid-run rank 0 checks that the store
                                    holds one key per node and no per-rank summary key
    node_summaries.py OUT kill      rank 2 (node 1's leader) kills itself at step KILL_AT;
                                    ranks 0, 1, 3 train on in a group of their own, then
                                    rank 3 hangs; rank 0 checks that node 1's key goes on
                                    carrying rank 3's new summaries, and every rank ends when
                                    rank 0's diagnoser has its verdicts (or after a deadline)

Printed lines: ``STORE <json>`` (rank 0), ``VERDICTS <json>`` (rank 0), ``NODE <json>``
(each rank, at step LOOK_AT + 15: the share of steps LOOK_AT..LOOK_AT + 15 at which its
agent had led its node at its last tick; a leader whose tick comes two ticks late on a
loaded host is replaced for that tick, by design).
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ccld_plugin
from ccld_plugin.wire.node_summary import decode_node, node_ranks
from ccld_plugin.wire.summary import decode_summary

KILL_AT = 8  # step at which rank 2 dies
LOOK_AT = 14  # step at which rank 0 starts looking at the store (beside training)
HANG_AT = 40  # step at which rank 3 stops (in the survivors' group)
STEP_S = 0.1
DEADLINE_S = 60.0

out, mode = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
session = ccld_plugin.enable(
    overrides=[
        f"board.dir={out / 'boards'}",
        "job=nodes",
        "agent.interval_s=0.5",
        "agent.stack_after_s=1",
        "diagnoser.hang_min_s=3",
        "diagnoser.unresponsive_s=4",
        "control.ranks_per_node=2",
        f"sinks.jsonl={out / 'verdicts.jsonl'}",
        "sinks.console=false",
    ]
)
assert session is not None and session.services is not None
agent = session.services.agent
store = agent.control.store
survivors = dist.new_group([0, 1, 3])  # every rank creates it, before any dies
if rank != 2:
    ccld_plugin.register_group(survivors, "dp")


def frames() -> dict[int, dict[int, int]]:
    """Per node key: each rank's summary time in it."""
    found = {}
    for node in range(world // 2):
        key = f"n/{node}"
        if store.check([key]):
            got = decode_node(bytes(store.get(key)), node_ranks(node, 2, world))
            found[node] = {r: decode_summary(b).time_ns for r, b in got.items()}
    return found


def look_at_store() -> None:
    first = frames()
    time.sleep(1.5)  # three ticks
    later = frames()
    found = {
        "node_size": bytes(store.get("node/size")).decode() if store.check(["node/size"]) else None,
        "rank_keys": [r for r in range(world) if store.check([f"s/{r}"])],
        "listed": store.check(["s/listed"]),
        "ranks_in_frames": {n: sorted(f) for n, f in later.items()},
        "advanced": {
            n: sorted(r for r in f if r in first.get(n, {}) and f[r] > first[n][r])
            for n, f in later.items()
        },
    }
    print("STORE " + json.dumps(found), flush=True)


led: list[bool] = []  # whether this rank's agent led its node, at each step from LOOK_AT


def look_beside_training(step: int) -> None:
    if rank == 0 and step == LOOK_AT:
        threading.Thread(target=look_at_store, daemon=True).start()
    if LOOK_AT <= step <= LOOK_AT + 15:
        led.append(agent.leading)
    if step == LOOK_AT + 15:  # while the store still answers every rank
        share = sum(led) / len(led)
        print("NODE " + json.dumps({"rank": rank, "leading": share}), flush=True)


def end_when_diagnosed() -> None:
    """Every rank ends once rank 0 wrote ``done`` (it has its verdicts), or at the
    deadline: the survivors' group is hung on purpose."""
    deadline = time.monotonic() + DEADLINE_S
    done = out / "done"
    while time.monotonic() < deadline and not done.exists():
        if rank == 0 and session.services is not None and session.services.diagnoser:
            verdicts = [v.to_dict() for v in session.services.diagnoser.verdicts]
            kinds = {v["kind"] for v in verdicts}
            if {"unresponsive", "hang"} <= kinds:
                print("VERDICTS " + json.dumps(verdicts), flush=True)
                done.write_text("")
                break
        time.sleep(0.2)
    os._exit(0)


t = torch.ones(16)
if mode == "healthy":
    for step in range(60):
        ccld_plugin.mark_step(step)
        look_beside_training(step)
        dist.all_reduce(t)
        time.sleep(STEP_S)
    ccld_plugin.disable()
    sys.exit(0)

threading.Thread(target=end_when_diagnosed, daemon=True).start()
for step in range(KILL_AT):
    ccld_plugin.mark_step(step)
    dist.all_reduce(t)
    time.sleep(STEP_S)
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    for step in range(KILL_AT, 1000):
        ccld_plugin.mark_step(step)
        if rank == 3 and step == HANG_AT:
            while True:  # a compute hang: never enters the next collective
                time.sleep(1)
        look_beside_training(step)
        dist.all_reduce(t, group=survivors)
        time.sleep(STEP_S)
except RuntimeError:
    # rank 0 leaves once it has its verdicts: its connections closing can end this rank's
    # wait (gloo raises) before this rank has seen ``done``
    for _ in range(50):
        if (out / "done").exists():
            os._exit(0)
        time.sleep(0.1)
    raise
