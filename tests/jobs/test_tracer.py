"""The collective tracer on real 4-rank gloo jobs."""

import json
from collections import defaultdict

from job_runner import run_job

COLLECTIVE_OPS = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
    "coalesced",
}
P2P_OPS = {"send", "recv", "isend", "irecv"}


def test_every_op_recorded_on_every_member_with_matching_trace_ids(tmp_path):
    res = run_job("every_op.py", 4, tmp_path, env={"BOARD_DIR": str(tmp_path / "b")}).check()
    ops = {r: res.json_lines(r, "OPS")[0] for r in range(4)}
    for r in range(4):
        assert {o["op"] for o in ops[r]} >= COLLECTIVE_OPS | P2P_OPS, ops[r]
        assert all(o["state"] == 2 and o["dur_ns"] > 0 for o in ops[r]), ops[r]
    # A collective's trace id (group, seq) names the same op on every member.
    members = defaultdict(dict)
    for r, recs in ops.items():
        for o in recs:
            if o["op"] not in P2P_OPS:
                members[(tuple(o["group"]), o["seq"])][r] = (o["op"], o["bytes"])
    for (group, seq), seen in members.items():
        assert set(seen) == set(group), f"trace id {group}:{seq} missing on some members"
        assert len({op for op, _ in seen.values()}) == 1, (group, seq, seen)
    # Seqs on a group are 1..n without gaps on every member.
    for recs in ops.values():
        by_group = defaultdict(list)
        for o in recs:
            if o["op"] not in P2P_OPS:
                by_group[tuple(o["group"])].append(o["seq"])
        for seqs in by_group.values():
            assert sorted(seqs) == list(range(1, len(seqs) + 1))
    # P2P: the k-th send a->b is the k-th recv of b from a.
    sends = {
        (r, o["peer"], o["seq"]): o["bytes"]
        for r in ops
        for o in ops[r]
        if o["op"] in ("send", "isend")
    }
    recvs = {
        (o["peer"], r, o["seq"]): o["bytes"]
        for r in ops
        for o in ops[r]
        if o["op"] in ("recv", "irecv")
    }
    assert sends and sends == recvs
    # The coalesced block is one op with the bytes of its members (3 + 5 floats).
    coalesced = [o for o in ops[0] if o["op"] == "coalesced"]
    assert coalesced and coalesced[0]["bytes"] == 32 and coalesced[0]["role"] == "tp"
    # async ops are flagged as such
    assert any(o["op"] == "all_reduce" and o["flags"] & 1 for o in ops[0])
    # Functional collectives (DTensor's), async from the call to the wait (or, the
    # all-gather's result dropped unwaited, to its release): between the coalesced block
    # and the captured reference's gather on the pair.
    for r in range(4):
        pair = [(o["op"], o["flags"] & 1, o["state"]) for o in ops[r] if o["role"] == "tp"]
        assert pair[-4:-1] == [
            ("all_reduce", 1, 2),
            ("all_gather_into_tensor", 1, 2),
            ("all_reduce", 1, 2),
        ], pair


def test_references_captured_before_install_are_traced_and_restored(tmp_path):
    res = run_job("every_op.py", 4, tmp_path, env={"BOARD_DIR": str(tmp_path / "b")}).check()
    for r in range(4):
        recs = res.json_lines(r, "OPS")[0]
        # captured_refs.gather is the last op on the pair group before the final barrier.
        pair_ops = [o for o in recs if o["role"] == "tp"]
        assert pair_ops[-1]["op"] == "all_gather_into_tensor"
        assert pair_ops[-1]["bytes"] == 32
        restored = res.json_lines(r, "RESTORED")[0]
        assert restored == {"all": True, "captured": True}


def test_traced_training_is_bit_identical_to_untraced(tmp_path):
    args = ("--tp", "2", "--pp", "2", "--steps", "3")
    run_job(
        "ccld_harness.workload",
        4,
        tmp_path / "plain",
        args=(*args, "--no-ccld", "--report-dir", str(tmp_path / "plain" / "r")),
    ).check()
    run_job(
        "ccld_harness.workload",
        4,
        tmp_path / "traced",
        args=(
            *args,
            "--report-dir",
            str(tmp_path / "traced" / "r"),
            "--ccld-set",
            f"board.dir={tmp_path / 'boards'}",
        ),
    ).check()
    for r in range(4):
        plain = json.loads((tmp_path / "plain" / "r" / f"rank{r}.json").read_text())
        traced = json.loads((tmp_path / "traced" / "r" / f"rank{r}.json").read_text())
        assert plain["losses"] == traced["losses"]
    assert json.loads((tmp_path / "plain" / "r" / "rank3.json").read_text())["losses"]
    # Boards are removed at normal exit by default.
    assert not list((tmp_path / "boards").rglob("*.board"))
