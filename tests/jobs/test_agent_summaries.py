"""What a rank's summaries carry, read back from a real job's recording of its diagnoser's
rounds: each repeats its previous tick's arrival and point-to-point samples (a summary
replaced before a round read it loses none), and the diagnoser joins each sampled
collective once."""

from __future__ import annotations

from pathlib import Path

from job_runner import demo

from ccld_plugin.diagnose.arrivals import ArrivalJoin
from ccld_plugin.postmortem.replay import round_views
from ccld_plugin.recording import read_recording
from ccld_plugin.wire.summary import arrival_samples, decode_summary, p2p_samples


def test_summaries_repeat_the_last_tick_samples_and_each_collective_joins_once(
    tmp_path: Path,
) -> None:
    rec = tmp_path / "rounds.rec"
    code, summary = demo(
        tmp_path / "out",
        "none",
        extra=(f"diagnoser.record={rec}",),
        framework="torch",
        world=4,
        tp=1,
        pp=2,  # two pipelines: DP all-reduces and pipeline sends
        steps=40,
        timeout_s=180,
    )
    assert code == 0 and summary["verdicts"] == []
    _, rounds = read_recording(rec)
    seen: dict[int, list] = {}
    join, joined = ArrivalJoin(), []
    for rr, view in round_views(rounds):  # as the live rounds took them
        fresh = []  # each rank's summary once
        for rank, data in rr.values.items():
            s = decode_summary(data)
            if rank in rr.tables and (not seen.get(rank) or seen[rank][-1].time_ns != s.time_ns):
                seen.setdefault(rank, []).append(s)
                fresh.append(s)
        joined += [(j.group.group_id, j.seq) for j in join.add(view, fresh)]
    repeated, repeated_p2p = 0, 0
    for summaries in seen.values():
        for before, after in zip(summaries, summaries[1:], strict=False):
            mine = {(a.slot, a.seq) for a in arrival_samples(before)}
            repeated += len(mine & {(a.slot, a.seq) for a in arrival_samples(after)})
            ends = {(p.slot, p.peer, p.sends, p.seq) for p in p2p_samples(before)}
            repeated_p2p += len(
                ends & {(p.slot, p.peer, p.sends, p.seq) for p in p2p_samples(after)}
            )
    assert repeated > 0 and repeated_p2p > 0  # a tick's samples go again in the next summary
    assert joined and len(joined) == len(set(joined))  # ... and join once
