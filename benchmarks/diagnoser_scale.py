"""Cost of one diagnoser round as the job grows (the goal: <= 100 ms at 16,384 ranks).

Synthetic but shaped like a real 3D-parallel job (TP8 x PP4 x DP rest) on nodes of 8
ranks: every rank's summary carries what the agent publishes in steady state (four
groups' progress, the last steps, the arrival samples per group the agent sends at that
size (`board_summary.samples_per_group`), a few channel entries)
and is encoded to the same bytes; each node's leader publishes its 8 ranks' summaries as
one node key (``wire.node_summary``), as the product does. Per round it times, separately:

- read: every node key from a real TCPStore on loopback, through the control plane the
  live diagnoser reads with (``ControlPlane.read_summaries``: existence check, chunked
  ``multi_get``, node frames split into per-rank summaries);
- decode: every rank's bytes into one SummaryTable (columns; a rank's RankSummary is
  decoded only when the analysis looks it up), read where they lie in the frames, after
  the merge with the last round's values and the check for news, as the diagnoser
  service does;
- view: the JobView (topology of every rank's group table);
- analyze: Analyzer.round (hang, mismatch, unresponsive, slow windows).

The ranks' steps advance one per round from a step in steady state (each summary carries
the steps of its last STEP_TICKS ticks, as an agent's do), so slow-detector windows close
as in a live job.
Prints the median of the rounds per stage and world size (the first round, which builds
the per-topology caches, left out), the slowest round, and the diagnoser's peak memory:
the peak resident memory of this process less what it held before the job's first round
(Python, torch, numpy). The store and the synthetic ranks (building and publishing the
summaries) run in processes of their own, so neither counts. Usage:
    python benchmarks/diagnoser_scale.py [--worlds 512,2048,16384] [--rounds 12] [--per-round]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from ccld_plugin.agent.board_summary import samples_per_group
from ccld_plugin.agent.recent_steps import STEP_TICKS, STEPS_KEPT
from ccld_plugin.config import ControlConfig, DiagnoserConfig
from ccld_plugin.control import ControlPlane
from ccld_plugin.diagnose import Analyzer, JobView
from ccld_plugin.diagnose.view import topology_of
from ccld_plugin.services.diagnosis_load import gc_paused
from ccld_plugin.topology import GroupInfo, group_id_of
from ccld_plugin.wire.node_summary import encode_node, node_count, node_ranks
from ccld_plugin.wire.packed import PackedSummaries
from ccld_plugin.wire.peer_channels import PeerChannel, encode_channels
from ccld_plugin.wire.summary import (
    ArrivalSample,
    GroupProgress,
    RankSummary,
    StepStat,
    encode_summary,
)
from ccld_plugin.wire.summary_batch import SummaryTable

TP, PP = 8, 4
RANKS_PER_NODE = 8
STEP_NS = 1_000_000_000
OPS_PER_STEP = 16
JOB = "bench"


def layout(world: int) -> dict[int, list[GroupInfo]]:
    """Every rank's group table: world, tp, pp, dp (Megatron order: tp fastest). A group is
    one object in every member's table, as the diagnoser keeps them."""
    dp = world // (TP * PP)
    world_g = GroupInfo(group_id_of(range(world)), "world", tuple(range(world)))
    known: dict[tuple[str, tuple[int, ...]], GroupInfo] = {}

    def group(role: str, ranks: list[int]) -> GroupInfo:
        key = (role, tuple(ranks))
        if key not in known:
            known[key] = GroupInfo(group_id_of(ranks), role, key[1])
        return known[key]

    tables = {}
    for r in range(world):
        t, p, d = r % TP, (r // TP) % PP, r // (TP * PP)
        tp = [d * TP * PP + p * TP + i for i in range(TP)]
        pp = [d * TP * PP + i * TP + t for i in range(PP)]
        dpg = [i * TP * PP + p * TP + t for i in range(dp)]
        tables[r] = [world_g, group("tp", tp), group("pp", pp), group("dp", dpg)]
    return tables


def summary(rank: int, world: int, step: int, now: int) -> bytes:
    return encode_summary(rank_summary(rank, world, step, now))


def rank_summary(rank: int, world: int, step: int, now: int) -> RankSummary:
    """Rank ``rank``'s steady-state summary at ``now`` (diagnoser clock), step ``step``."""
    seq = (step + 1) * OPS_PER_STEP
    start = now - STEP_NS
    groups = [
        GroupProgress(slot, seq, seq, OPS_PER_STEP, 20_000, 1 << 22, 3_000) for slot in range(4)
    ]
    samples = [
        ArrivalSample(slot, seq - 2 * i, start + i * 50_000_000 + rank % 7 * 1000, 2_000, 1 << 20)
        for slot in range(4)
        for i in range(samples_per_group(world))
    ]
    # the next rank of its TP, PP and DP rings
    block = rank - rank % (TP * PP)
    peers = [
        rank - rank % TP + (rank + 1) % TP,
        block + (rank - block + TP) % (TP * PP),
        (rank + TP * PP) % world,
    ]
    channels = encode_channels(
        [
            PeerChannel(
                p, "none", "send", 2, 0, 1 << 20, 1 << 20, 0, 120, 40, 0, 0.0, 0.0, 0.1, 0.0
            )
            for p in peers
        ],
        1.0,
        6,
    )
    return RankSummary(
        rank=rank,
        pid=1000 + rank,
        host=f"node{rank // 8}",
        time_ns=now,
        heartbeat_ns=now,
        step=step,
        last_progress_ns=now - 1000,
        groups_version=1,
        groups=groups,
        # the steps of the last STEP_TICKS ticks (one a tick), as the agent sends them
        steps=[
            StepStat(k, now - (step - k) * STEP_NS, 1_000_000, 700_000 + rank % 13 * 100)
            for k in range(max(0, step - min(STEP_TICKS, STEPS_KEPT)), step)
        ],
        samples=samples,
        channels=channels,
    )


def publish(port: int, world: int, conn: Connection) -> None:
    """The synthetic ranks, in a process of their own: for each step received, every
    node leader's key (its ranks' summaries at that step) written to the store."""
    cfg = ControlConfig(store="dedicated", port=port)
    plane = ControlPlane(cfg, 1, world, JOB, 0, ranks_per_node=RANKS_PER_NODE)
    size = 0
    while (step := conn.recv()) is not None:
        now = step * STEP_NS
        for n in range(node_count(world, RANKS_PER_NODE)):
            ranks = node_ranks(n, RANKS_PER_NODE, world)
            encoded = [(r, summary(r, world, step, now)) for r in ranks]
            size = len(encoded[0][1])
            plane.publish_node(n, encode_node(encoded))
        conn.send(size)


def bench(
    world: int, rounds: int, port: int, rss_before: float, per_round: bool = False
) -> dict[str, float]:
    ranks_conn, theirs = mp.get_context("spawn").Pipe()
    ranks = mp.get_context("spawn").Process(target=publish, args=(port, world, theirs), daemon=True)
    ranks.start()
    # the live diagnoser's read: a control plane outside the job (``ccld diagnoser``)
    plane = ControlPlane.client(ControlConfig(), "127.0.0.1", port, JOB, world)
    tables = layout(world)
    topology = topology_of(tables)
    diag = Analyzer(DiagnoserConfig(), interval_s=1.0)
    times: dict[str, list[float]] = {k: [] for k in ("read", "decode", "view", "analyze")}
    size = 0
    last = PackedSummaries.of({})
    # from a step in steady state: every summary carries as many steps as an agent's do
    for step in range(STEP_TICKS + 1, STEP_TICKS + rounds + 1):
        now = step * STEP_NS
        ranks_conn.send(step)  # the ranks publish (not timed)
        size = ranks_conn.recv()
        t0 = time.perf_counter()
        raw = plane.read_summaries(range(world))
        t1 = time.perf_counter()
        assert len(raw) == world, len(raw)
        with gc_paused():  # as the diagnoser runs a round
            # the service's merge with the last good values, and its check for news
            values = last.merged(raw)
            assert values != last
            summaries, bad = SummaryTable.decode(values)
            last = values
            t2 = time.perf_counter()
            assert not bad, bad
            # the diagnoser rebuilds the topology only when a table changes
            view = JobView(
                summaries=summaries,
                tables=tables,
                now_ns=now,
                job_start_ns=0,
                world=world,
                topology=topology,
            )
            t3 = time.perf_counter()
            verdicts = diag.round(view)
            t4 = time.perf_counter()
        assert not verdicts, [v.to_dict() for v in verdicts]  # a healthy job: no verdict
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[k].append(dt * 1000)
        if per_round:
            stages = " ".join(f"{k} {v[-1]:.1f}" for k, v in times.items())
            print(f"  {world} ranks, round {step}: {stages} ms", flush=True)
    ranks_conn.send(None)
    ranks.join()
    out = {k: statistics.median(v[1:] if len(v) > 2 else v) for k, v in times.items()}
    rounds_ms = [sum(x) for x in zip(*times.values(), strict=True)][1:]
    out["round"], out["worst"] = statistics.median(rounds_ms), max(rounds_ms)
    out["bytes"] = size
    out["diag_mb"] = _peak_rss_mb() - rss_before
    return out


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# The store in a process of its own, as on a job's store host: its memory is not the
# diagnoser's. It prints its port and serves until its stdin closes.
_STORE = """
import sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="512,2048,16384")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--per-round", action="store_true", help="print every round's times")
    args = ap.parse_args()
    rss_before = _rss_mb()  # Python, torch, numpy: not the diagnoser's
    server = subprocess.Popen(
        [sys.executable, "-c", _STORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    port = int(server.stdout.readline())
    print(
        f"nodes of {RANKS_PER_NODE} ranks, one store key each; medians over the rounds; "
        "'worst' is the slowest round (one that closes a slow-detector window); 'diag MB' "
        "is the diagnoser's peak memory (this process's peak RSS less its RSS before the "
        f"first job, {rss_before:.0f} MB)"
    )
    print(
        f"{'ranks':>7} {'summary B':>9} {'read ms':>8} {'decode ms':>9} {'view ms':>8} "
        f"{'analyze ms':>10} {'round ms':>9} {'worst ms':>9} {'diag MB':>8}"
    )
    for world in (int(w) for w in args.worlds.split(",")):
        r = bench(world, args.rounds, port, rss_before, args.per_round)
        print(
            f"{world:>7} {r['bytes']:>9} {r['read']:>8.1f} {r['decode']:>9.1f} "
            f"{r['view']:>8.1f} {r['analyze']:>10.1f} {r['round']:>9.1f} "
            f"{r['worst']:>9.1f} {r['diag_mb']:>8.0f}",
            flush=True,
        )
    server.communicate("")


if __name__ == "__main__":
    main()
