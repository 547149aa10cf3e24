"""A 4-rank gloo job that runs a few seconds with clock re-syncs every second; prints each
rank's count of re-syncs and its final offset to the diagnoser's clock."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ccld_plugin

out = Path(sys.argv[1])
dist.init_process_group("gloo")
session = ccld_plugin.enable(
    overrides=[
        f"board.dir={out / 'boards'}",
        "job=clock",
        "agent.interval_s=0.5",
        "agent.clock_resync_s=1",
        f"sinks.jsonl={out / 'verdicts.jsonl'}",
        "sinks.console=false",
    ]
)
assert session is not None
t = torch.ones(16)
for step in range(100):  # ~5 s: every rank runs the same steps
    ccld_plugin.mark_step(step)
    dist.all_reduce(t)
    time.sleep(0.05)
agent = session.services.agent
print(
    "CLOCK " + json.dumps({"resyncs": agent.resyncs, "offset_ns": agent.clock.offset_ns}),
    flush=True,
)
ccld_plugin.disable()
