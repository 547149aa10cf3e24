"""Seconds from a fault's onset to its verdict at 16,384 and 65,536 ranks, in simulation.

The job of ``diagnoser_scale.py`` (TP8 x PP4 x DP, steady-state summaries) runs on a
simulated clock: every rank publishes a summary each 1 s agent tick, and the real
``Analyzer`` runs rounds over the decoded summaries, each round timed for real. Where
the diagnoser lives sets when its rounds come:

- ``rank``: a thread on a training rank, which keeps its rounds to 20% of that rank's time
  (``services.diagnosis_load.MAX_ROUND_SHARE``): after a round of cost c it waits
  max(interval / 2, 4c);
- ``process``: ``ccld diagnoser``, a process of its own: rounds back to back, at most one
  per half interval.

Two faults, each in a run of its own, start at a known tick: a compute hang (rank H stops
outside any collective; its TP peers block in an all-reduce it never enters) and a 2x
straggler (rank S computes twice as long and arrives last at its collectives). A verdict
counts when it names the rank with the expected kind and cause; it is seen at the end of
the round that made it. Reading the summaries from the store is not simulated (see
``store_load.py`` and ``diagnoser_scale.py`` for its cost). Usage:

    python benchmarks/verdict_latency_scale.py [--worlds 16384,65536] [--onset 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from diagnoser_scale import OPS_PER_STEP, STEP_NS, TP, layout, rank_summary

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose import Analyzer, JobView
from ccld_plugin.diagnose.view import topology_of
from ccld_plugin.services.diagnosis_load import MAX_ROUND_SHARE, gc_paused
from ccld_plugin.wire.codes import OP_CODES
from ccld_plugin.wire.summary import (
    ArrivalSample,
    InFlightOp,
    RankSummary,
    StepStat,
    encode_summary,
)
from ccld_plugin.wire.summary_batch import SummaryTable

INTERVAL_S = 1.0
TP_SLOT = 1  # layout(): world, tp, pp, dp
DELAY_NS = 300_000_000  # the straggler's late arrival at each collective


def faulted(
    s: RankSummary, world: int, fault: str, rank: int, onset: int, tick: int
) -> RankSummary:
    """``s`` (rank s.rank's healthy summary at ``tick``) as the fault makes it."""
    if tick < onset:
        return s
    onset_ns = onset * STEP_NS
    if fault == "hang" and (s.rank == rank or s.rank // TP == rank // TP):
        stuck = dataclasses.replace(
            rank_summary(s.rank, world, onset - 1, onset_ns), time_ns=s.time_ns
        )
        stuck.heartbeat_ns, stuck.last_progress_ns = s.time_ns, onset_ns
        stuck.steps, stuck.samples = [], []
        if s.rank != rank:  # a TP peer: entered the next all-reduce, which never ends
            seq = stuck.groups[TP_SLOT].entered_seq + 1
            stuck.groups[TP_SLOT] = stuck.groups[TP_SLOT]._replace(entered_seq=seq)
            stuck.in_flight = [
                InFlightOp(TP_SLOT, OP_CODES["all_reduce"], 0, -1, seq, 1 << 20, onset_ns)
            ]
        return stuck
    if fault == "slow" and s.rank == rank:
        s.steps = [  # the steps since the onset take twice the compute
            StepStat(st.step, st.start_ns, st.step_us + st.compute_us, 2 * st.compute_us)
            if st.step >= onset
            else st
            for st in s.steps
        ]
        s.samples = [
            ArrivalSample(a.slot, a.seq, a.enter_ns + DELAY_NS, a.dur_us, a.bytes)
            for a in s.samples
        ]
    elif fault == "slow":  # everyone else waits for it at every collective
        s.samples = [a._replace(dur_us=a.dur_us + DELAY_NS // 1000) for a in s.samples]
    return s


def run(world: int, where: str, fault: str, rank: int, onset: int, ticks: int) -> dict:
    tables = layout(world)
    topology = topology_of(tables)
    diag = Analyzer(DiagnoserConfig(), interval_s=INTERVAL_S)
    want = {"hang": ("hang", "compute"), "slow": ("slow", "compute")}[fault]
    t, encoded_tick, raw = 1.0, -1, {}
    costs = []
    while t < ticks:
        tick = int(t)
        if tick != encoded_tick:  # the agents' summaries of this tick (not timed)
            raw = {
                r: encode_summary(
                    faulted(
                        rank_summary(r, world, tick, tick * STEP_NS),
                        world,
                        fault,
                        rank,
                        onset,
                        tick,
                    )
                )
                for r in range(world)
            }
            encoded_tick = tick
        t0 = time.perf_counter()
        with gc_paused():
            summaries, _ = SummaryTable.decode(raw)  # as the diagnoser does
            view = JobView(
                summaries=summaries,
                tables=tables,
                now_ns=int(t * STEP_NS),
                job_start_ns=0,
                world=world,
                topology=topology,
            )
            verdicts = diag.round(view)
        cost = time.perf_counter() - t0
        costs.append(cost)
        seen = t + cost
        for v in verdicts:
            if (v.kind, v.cause) == want and v.ranks == [rank]:
                return {"latency_s": seen - onset, "rounds": len(costs), "cost_s": max(costs)}
            if t >= onset:  # anything else after the onset is a wrong verdict
                return {"wrong": v.to_dict(), "rounds": len(costs)}
        if where == "rank":
            pause = max(INTERVAL_S / 2, cost * (1 - MAX_ROUND_SHARE) / MAX_ROUND_SHARE)
        else:
            pause = max(0.0, INTERVAL_S / 2 - cost)
        t = seen + pause
    return {"latency_s": None, "rounds": len(costs), "cost_s": max(costs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="16384,65536")
    ap.add_argument("--onset", type=int, default=20, help="tick (s, = step) the fault starts")
    ap.add_argument("--ticks", type=int, default=60, help="simulated seconds at most")
    args = ap.parse_args()
    cfg = DiagnoserConfig()
    print(
        f"hang threshold floor {cfg.hang_min_s:g} s; straggler: {cfg.confirm_windows} windows "
        f"of {cfg.window_steps} steps; one step per 1 s tick; {OPS_PER_STEP} ops per step"
    )
    print(f"{'ranks':>7} {'diagnoser':>9} {'fault':>6} {'verdict after s':>15} {'rounds':>7}")
    for world in (int(w) for w in args.worlds.split(",")):
        for where in ("rank", "process"):
            for fault, rank in (("hang", world // 3), ("slow", world // 5)):
                r = run(world, where, fault, rank, args.onset, args.ticks)
                got = (
                    f"WRONG {r['wrong']['kind']} {r['wrong']['ranks']}"
                    if "wrong" in r
                    else (f"{r['latency_s']:.1f}" if r["latency_s"] is not None else "none")
                )
                print(f"{world:>7} {where:>9} {fault:>6} {got:>15} {r['rounds']:>7}", flush=True)


if __name__ == "__main__":
    main()
