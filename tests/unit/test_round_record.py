"""A recording of the diagnoser's rounds (diagnoser.record) replays to the same verdicts,
with another config when asked, and refuses what is not one."""

from __future__ import annotations

import json
import pickle

import pytest
from builders import S, group, rank_summary

from ccld_plugin.config import CcldConfig, load_config, to_yaml
from ccld_plugin.postmortem.replay import replay
from ccld_plugin.recording import RecordedRound, RoundRecorder, read_recording
from ccld_plugin.wire.codes import OP_CODES
from ccld_plugin.wire.summary import GroupProgress, InFlightOp, encode_summary


def _rounds(tmp_path, cfg: CcldConfig):
    """Rank 1 of a DP pair stops in compute at t=88 s; rank 0 waits in all_reduce seq 8.
    Recorded a round a second from t=89 to t=105, every rank reporting each second."""
    dp = group("dp", [0, 1])
    tables = {0: [dp], 1: [dp]}
    path = tmp_path / "rounds.rec"
    rec = RoundRecorder(path, to_yaml(cfg))
    for t in range(89, 106):
        now = t * S
        stuck = [InFlightOp(0, OP_CODES["all_reduce"], 0, -1, 8, 64, 88 * S)]
        values = {
            0: encode_summary(
                rank_summary(
                    0,
                    now,
                    last_progress_ns=88 * S,
                    groups=[GroupProgress(0, 8, 7, 0, 0, 0, 0)],
                    in_flight=stuck,
                )
            ),
            1: encode_summary(
                rank_summary(
                    1, now, last_progress_ns=88 * S, groups=[GroupProgress(0, 7, 7, 0, 0, 0, 0)]
                )
            ),
        }
        rec.write(RecordedRound(now_ns=now, job_start_ns=0, world=2, values=values, tables=tables))
    rec.close()
    return path


def test_replay_gives_the_live_verdicts_and_follows_overrides(tmp_path):
    cfg = load_config(None, ["diagnoser.hang_min_s=3", "agent.interval_s=1"], writing=False)
    path = _rounds(tmp_path, cfg)
    used, verdicts = replay(path)
    assert used.diagnoser.hang_min_s == 3  # the recording's own config
    (h,) = verdicts
    assert (h.kind.value, h.cause.value, h.ranks) == ("hang", "compute", [1])
    # Twice the 3 s floor (the group's first op), from the onset at 88 s: at 94 s.
    assert h.detected_s == pytest.approx(94, abs=1)
    # Another threshold, same recording: later.
    _, later = replay(path, overrides=["diagnoser.hang_min_s=6"])
    assert [v.ranks for v in later] == [[1]] and later[0].detected_s == pytest.approx(100, abs=1)
    # Past the end of the recording: no verdict.
    _, none = replay(path, overrides=["diagnoser.hang_min_s=10"])
    assert none == []


def test_only_plain_values_are_read(tmp_path):
    path = tmp_path / "evil.rec"
    with open(path, "wb") as f:
        pickle.dump({"format": "ccld-rounds/1", "config": ""}, f)
        pickle.dump(CcldConfig(), f)  # a class: refused, not loaded
    _, rounds = read_recording(path)
    assert list(rounds) == []
    other = tmp_path / "other.bin"
    other.write_bytes(b"\x00not a recording")
    with pytest.raises(ValueError, match="not a ccld round recording"):
        read_recording(other)


def test_ccld_replay_prints_the_verdicts_and_refuses_a_bad_file(tmp_path, capsys):
    from ccld_plugin.cli import main

    cfg = load_config(None, ["diagnoser.hang_min_s=3", "agent.interval_s=1"], writing=False)
    path = _rounds(tmp_path, cfg)
    out = tmp_path / "v.jsonl"
    assert main(["replay", str(path), "--jsonl", str(out)]) == 0
    assert "HANG compute-bound: rank 1" in capsys.readouterr().out
    assert [v["ranks"] for v in map(json.loads, out.read_text().splitlines())] == [[1]]
    bad = tmp_path / "bad.rec"
    bad.write_text("not a recording")
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a ccld round recording" in err[0]
