"""Post-mortem diagnosis over boards (``ccld diagnose``): the summary a board gives, who
died first judged from the boards against each other, clock offsets, and the checks that a
directory holds the boards of one job."""

from __future__ import annotations

import pytest
from builders import MS, NOW, S, facts, group, rank_board

from ccld_plugin import _native
from ccld_plugin.agent.board_summary import summarize_board
from ccld_plugin.board.job_files import JOB_CONFIG, write_stack
from ccld_plugin.cli import main
from ccld_plugin.config import load_config
from ccld_plugin.postmortem.boards import JobBoards, PostmortemError, load_boards
from ccld_plugin.postmortem.diagnose_boards import diagnose_boards, job_config, job_view
from ccld_plugin.wire.codes import STATE_ERROR
from ccld_plugin.wire.summary import FLAG_ERRORED

CFG = load_config(None, ["diagnoser.hang_min_s=3", "agent.interval_s=0.5"])
DP = group("dp", range(4))


def _op(seq: int, enter_s: float, exit_s: float | None = None, **kw: object) -> dict:
    return dict(
        seq=seq,
        enter_ns=int(enter_s * S),
        exit_ns=None if exit_s is None else int(exit_s * S),
        **kw,
    )


def _history(last_seq: int, end_s: float) -> list[dict]:
    """Completed all-reduces, one per second, 10 ms each, up to ``end_s``."""
    return [
        _op(q, end_s - (last_seq - q) - 0.01, end_s - (last_seq - q))
        for q in range(1, last_seq + 1)
    ]


def _shift(ops: list[dict], by_ns: int) -> list[dict]:
    """The ops as a clock ``by_ns`` ahead reads them."""
    return [
        {**o, "enter_ns": o["enter_ns"] + by_ns, "exit_ns": o["exit_ns"] and o["exit_ns"] + by_ns}
        for o in ops
    ]


def _job(*boards: object, world: int = 4) -> JobBoards:
    return JobBoards("j", world, {b.snap.header.rank: b for b in boards})  # type: ignore[attr-defined]


def test_summary_of_a_board_is_on_the_diagnosers_clock():
    ahead = 7 * S  # this rank's clock runs 7 s ahead of the diagnoser's
    ops = [_op(1, 91, 91.5), _op(2, 95, 96, state=STATE_ERROR), _op(3, 97)]
    b = rank_board(1, 4, [DP], _shift(ops, ahead), offset_ns=ahead)
    s = summarize_board(b.snap, NOW + ahead, 0, ahead, groups_version=1, exited=True)
    assert s.time_ns == NOW and s.exited and s.flags & FLAG_ERRORED
    flight, error = s.in_flight
    assert (flight.seq, flight.enter_ns, flight.state) == (3, 97 * S, 1)
    assert (error.seq, error.state) == (2, STATE_ERROR)
    assert s.last_progress_ns == 96 * S  # the last op that ended
    (gp,) = s.groups
    assert (gp.entered_seq, gp.completed_seq, gp.ops, gp.max_dur_us) == (3, 2, 1, 500_000)


def test_hang_root_among_ranks_killed_together_with_skewed_clocks():
    # Killed while hung: every heartbeat stops within a tick; rank 2 never entered seq 6.
    # Rank 3's clock is 1000 s ahead: only its offset puts it with the others.
    far = 1000 * S
    waiting = [*_history(5, 80), _op(6, 80.1)]
    boards = [rank_board(r, 4, [DP], waiting, heartbeat_ns=NOW - r * 100 * MS) for r in (0, 1)]
    root = rank_board(2, 4, [DP], _history(5, 80), heartbeat_ns=NOW - 200 * MS)
    root.stack = ["train.py:10 in main", "train.py:3 in stuck"]
    boards.append(
        rank_board(3, 4, [DP], _shift(waiting, far), heartbeat_ns=NOW + far, offset_ns=far)
    )
    verdicts = diagnose_boards(_job(*boards, root), CFG)
    (v,) = [x.to_dict() for x in verdicts]
    assert (v["kind"], v["cause"], v["ranks"], v["group"]["role"]) == ("hang", "compute", [2], "dp")
    assert v["op"] == "all_reduce" and v["trace_id"].endswith(":6")
    assert v["stack"] == root.stack
    # seconds since the job's start (0 s on every clock): the last heartbeat, the last op
    assert (v["detected_s"], v["onset_s"]) == (100.0, 80.0)


def test_rank_that_died_first_is_named_not_the_ranks_left_waiting_for_it():
    # Rank 1 was killed at ~80 s; the others waited in seq 6 for it until the job was
    # killed at 100 s. On another host, its process cannot be checked: the stale heartbeat
    # alone says it stopped first.
    waiting = [*_history(5, 79), _op(6, 79.5)]
    boards = [rank_board(r, 4, [DP], waiting) for r in (0, 2, 3)]
    dead = rank_board(1, 4, [DP], _history(5, 79), heartbeat_ns=80 * S, host="elsewhere")
    view = job_view(_job(*boards, dead), CFG)
    assert view.gone == {1} and view.now_ns == NOW
    (v,) = [x.to_dict() for x in diagnose_boards(_job(*boards, dead), CFG)]
    assert (v["kind"], v["ranks"], v["onset_s"]) == ("unresponsive", [1], 80.0)
    assert "process_gone" in facts(v["evidence"])


def test_ranks_that_exited_cleanly_give_no_verdict():
    boards = [rank_board(r, 4, [DP], _history(5, 90), closed=True) for r in range(4)]
    assert diagnose_boards(_job(*boards), CFG) == []


def _board(path, rank, world=4, job="j"):
    b = _native.Board(str(path / f"rank{rank}.board"), rank, world, job, "h", 16, 4, 4, 16)
    b.register_group(DP.group_id, 3, list(DP.ranks), rank)
    return b


def test_boards_of_different_jobs_are_refused_in_one_line(tmp_path, capsys):
    boards = [_board(tmp_path, 0, job="a"), _board(tmp_path, 1, job="b")]
    with pytest.raises(PostmortemError, match="2 different jobs.*'a' of world 4.*'b' of world 4"):
        load_boards(tmp_path)
    assert main(["diagnose", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ccld: error: boards of 2 different jobs") and "\n" not in err
    for b in boards:
        b.close()


def test_missing_boards_are_said_and_the_rest_diagnosed(tmp_path, capsys):
    boards = [_board(tmp_path, r) for r in (0, 2)]
    write_stack(tmp_path / "rank2.board", ["a.py:1 in f"])
    (tmp_path / "rank3.board").write_bytes(b"not a board")
    job = load_boards(tmp_path)
    assert sorted(job.ranks) == [0, 2] and job.missing() == [1, 3]
    assert job.ranks[2].stack == ["a.py:1 in f"]
    (unreadable,) = job.unreadable
    assert "rank3.board: 11 bytes is too small for a board" in unreadable
    assert any("no board for rank(s) [1, 3] of 4" in n for n in job.notes)
    # as ccld inspect: the board that cannot be read is said on stderr, and the exit is 1
    assert main(["diagnose", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "2 of 4 boards" in out and "no board for rank(s) [1, 3]" in out
    assert err.strip() == f"ccld: error: {unreadable}"
    for b in boards:
        b.close()


def test_no_boards_is_one_line(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path)]) == 2
    assert "no readable board (*.board)" in capsys.readouterr().err


def test_the_jobs_own_thresholds_are_used_then_overrides(tmp_path):
    (tmp_path / JOB_CONFIG).write_text("diagnoser:\n  hang_min_s: 4.5\n")
    assert job_config(tmp_path, None, []).diagnoser.hang_min_s == 4.5
    cfg = job_config(tmp_path, None, ["diagnoser.hang_min_s=2"])
    assert cfg.diagnoser.hang_min_s == 2


def test_a_saved_config_loads_where_the_jobs_output_paths_do_not_exist(tmp_path):
    # Boards copied off a dead node: the job's sinks lived on that node, and the
    # post-mortem writes none of them, so their paths are not checked here.
    gone = tmp_path / "node7-local"  # a file here: nothing can be written under it
    gone.write_text("")
    (tmp_path / JOB_CONFIG).write_text(
        f"board:\n  dir: {gone}/boards\nsinks:\n  jsonl: {gone}/v.jsonl\n"
    )
    assert job_config(tmp_path, None, []).sinks.jsonl == f"{gone}/v.jsonl"


def test_rank_whose_peers_failed_after_it_went_silent_died_first():
    # Rank 1 was killed; gloo raised in its peers' next all-reduce a moment later (well
    # within a tick), and they left through the exit path.
    raised = [*_history(5, 99), _op(6, 99.6, 99.7, state=STATE_ERROR)]
    boards = [
        rank_board(r, 4, [DP], raised, heartbeat_ns=int(99.7 * S), closed=True) for r in (0, 2, 3)
    ]
    dead = rank_board(1, 4, [DP], _history(5, 99), heartbeat_ns=int(99.5 * S))
    (v,) = [x.to_dict() for x in diagnose_boards(_job(*boards, dead), CFG)]
    assert (v["kind"], v["ranks"]) == ("unresponsive", [1])
    # The same boards without the failed collectives: nobody is known to have died first.
    calm = [rank_board(r, 4, [DP], _history(5, 99), heartbeat_ns=int(99.7 * S)) for r in (0, 2, 3)]
    assert job_view(_job(*calm, dead), CFG).gone == set()


def test_collectives_that_timed_out_are_judged_at_the_first_timeout():
    # Rank 2 stopped in compute at 80 s; its peers' all-reduce seq 6 timed out at 90 s (one
    # after another), they raised and left through the exit path; the scheduler killed rank
    # 2 at 120 s. At the end only rank 2 is left and it is in no collective: the hang shows
    # at the first timeout, when the others still waited in seq 6.
    boards = [
        rank_board(
            r,
            4,
            [DP],
            [*_history(5, 80), _op(6, 80.1 + r / 100, 90 + r / 10, state=STATE_ERROR)],
            heartbeat_ns=int((90.2 + r / 10) * S),
            closed=True,
        )
        for r in (0, 1, 3)
    ]
    hung = rank_board(2, 4, [DP], _history(5, 80), heartbeat_ns=120 * S, host="elsewhere")
    view = job_view(_job(*boards, hung), CFG)
    assert view.now_ns == 90 * S and view.gone == set()
    assert not any(s.exited for s in view.summaries.values())
    (v,) = [x.to_dict() for x in diagnose_boards(_job(*boards, hung), CFG)]
    assert (v["kind"], v["cause"], v["ranks"], v["group"]["role"]) == ("hang", "compute", [2], "dp")
    assert v["trace_id"].endswith(":6") and (v["onset_s"], v["detected_s"]) == (80.0, 90.0)


def test_peers_raising_one_after_another_are_not_taken_for_the_dead_rank():
    # Rank 2 was killed at 80 s; its peers' collectives raised within 0.3 s of each other
    # and they died without the exit path (as torchrun's SIGTERM ends them): each raised,
    # so each was alive when the first did; only rank 2 had gone silent before.
    boards = [
        rank_board(
            r,
            4,
            [DP],
            [*_history(5, 79.9), _op(6, 79.95, 80.05 + r / 10, state=STATE_ERROR)],
            heartbeat_ns=int((80.05 + r / 10) * S),
            host="elsewhere",
        )
        for r in (0, 1, 3)
    ]
    dead = rank_board(2, 4, [DP], _history(5, 79.9), heartbeat_ns=int(79.9 * S), host="elsewhere")
    assert job_view(_job(*boards, dead), CFG).gone == {2}
    (v,) = [x.to_dict() for x in diagnose_boards(_job(*boards, dead), CFG)]
    assert (v["kind"], v["ranks"]) == ("unresponsive", [2])


def test_ranks_the_launcher_ended_in_an_op_nobody_failed_in_did_not_die_first():
    # DP pairs [0, 1] and [2, 3]. Rank 1 died at 79.9 s (gloo aborted it); rank 0's
    # all-reduce with it raised at 80.05 s. Ranks 2 and 3 sat in their own pair's
    # all-reduce until torchrun ended them: they raised nothing and their last tick
    # predates the failure, yet no failed op was with them. (An unseen script's
    # post-mortem named rank 2 unresponsive too.)
    pair01, pair23 = group("dp", [0, 1]), group("dp", [2, 3])
    raised = [*_history(5, 79.9), _op(6, 79.95, 80.05, state=STATE_ERROR)]
    failed = rank_board(0, 4, [pair01], raised, heartbeat_ns=int(80.05 * S), host="elsewhere")
    dead = rank_board(
        1, 4, [pair01], _history(5, 79.9), heartbeat_ns=int(79.9 * S), host="elsewhere"
    )
    waiting = [
        rank_board(
            r,
            4,
            [pair23],
            [*_history(5, 79.9), _op(6, 79.95)],
            heartbeat_ns=int(79.7 * S),
            host="elsewhere",
        )
        for r in (2, 3)
    ]
    assert job_view(_job(failed, dead, *waiting), CFG).gone == {1}
    verdicts = [x.to_dict() for x in diagnose_boards(_job(failed, dead, *waiting), CFG)]
    assert [(v["kind"], v["ranks"]) for v in verdicts] == [("unresponsive", [1])]


def test_a_later_failure_over_a_larger_group_does_not_implicate_its_bystanders():
    # An unseen MoE script: rank 1 was killed at 79.9 s; rank 0's all-to-all with it
    # (ep [0, 1]) raised at 80.05, then rank 2's world all-reduce at 80.10, once rank 0
    # had gone. Rank 3 sat in that all-reduce until torchrun ended it. The world op's
    # failure named rank 3 as having died first, beside rank 1.
    world, ep01, ep23 = group("world", range(4)), group("ep", [0, 1]), group("ep", [2, 3])
    hist = _history(5, 79.9)
    raised = [*hist, _op(1, 79.95, 80.05, slot=1, op="all_to_all_single", state=STATE_ERROR)]
    first = rank_board(0, 4, [world, ep01], raised, heartbeat_ns=int(80.05 * S), host="x")
    dead = rank_board(1, 4, [world, ep01], hist, heartbeat_ns=int(79.9 * S), host="x")
    later = rank_board(
        2,
        4,
        [world, ep23],
        [*hist, _op(6, 79.95, 80.10, state=STATE_ERROR)],
        heartbeat_ns=int(80.10 * S),
        host="x",
    )
    ended = rank_board(
        3, 4, [world, ep23], [*hist, _op(6, 79.95)], heartbeat_ns=int(79.7 * S), host="x"
    )
    job = _job(first, dead, later, ended)
    assert job_view(job, CFG).gone == {1}
    verdicts = [x.to_dict() for x in diagnose_boards(job, CFG)]
    assert [(v["kind"], v["ranks"]) for v in verdicts] == [("unresponsive", [1])]


def test_boards_of_one_job_kept_on_two_hosts_are_diagnosed_together(tmp_path, capsys):
    # Each node kept its ranks' boards in its own folder (board.dir on a local disk); the
    # job's config is beside the diagnoser rank's, on the first node.
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    boards = [_board(node0, r) for r in (0, 1)] + [_board(node1, r) for r in (2, 3)]
    (node1 / JOB_CONFIG).write_text("diagnoser:\n  hang_min_s: 4.5\n")
    job = load_boards(node0, node1)
    assert sorted(job.ranks) == [0, 1, 2, 3] and job.missing() == [] and job.notes == []
    assert main(["diagnose", str(node0), str(node1)]) == 0
    out = capsys.readouterr().out
    assert "4 of 4 boards" in out and "no board for" not in out
    # a folder given twice: one rank, two boards
    with pytest.raises(PostmortemError, match="rank [01] has two boards"):
        load_boards(node0, node1, node0)
    for b in boards:
        b.close()
