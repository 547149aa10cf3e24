"""The W&B diagnosis panels.

Real jobs and a real wandb (offline): a hung demo job logs into a run of the sink's own,
and the run file is read back with the plugin's own reader; the same job with wandb made
unimportable still diagnoses; panels go into a user's existing run without disturbing its
steps. The panel numbers themselves are checked on synthetic views.
"""

from __future__ import annotations

import struct
import zlib
from datetime import datetime, timezone

import numpy as np
import pytest
from builders import S, job_view
from wandb_views import (
    DP,
    STEP_NS,
    TABLES,
    job_views,
    joined_samples,
    panel_summary,
    slow_link_verdict,
)

from ccld_plugin.config import DiagnoserConfig, WandbConfig, load_config
from ccld_plugin.diagnose import Analyzer, JobView
from ccld_plugin.diagnose.records import VERDICT_SCHEMA_VERSION, Culprit, Device
from ccld_plugin.sinks import build_sinks
from ccld_plugin.sinks.wandb.heatmap import encode_png, heatmap_rgb
from ccld_plugin.sinks.wandb.panels import PanelMetrics, group_key, hang_watch
from ccld_plugin.sinks.wandb.sink import WandbSink
from ccld_plugin.sinks.wandb.verdicts import VERDICT_COLUMNS, alert_message, verdict_row
from ccld_plugin.wire.codes import OP_CODES
from ccld_plugin.wire.summary import InFlightOp


def test_step_rows_wait_for_every_rank_and_decompose_the_step():
    m = PanelMetrics()
    v0, v1 = job_views(2)
    (row,) = m.update(v0, joined_samples(0))
    assert m.update(v0, []) == []  # the same summaries read again add nothing
    assert (row.step, row.ranks, row.step_ms, row.compute_ms, row.compute_max_ms) == (
        0,
        4,
        100.0,
        60.0,
        120.0,
    )
    assert (row.slowest_rank, row.slowest_ratio) == (2, 2.0)  # vs its DP cohort's 60 ms
    assert row.blocked_ms == {"dp": 20.0, "tp": 10.0}
    assert (row.skew_ms, row.skew_role, row.skew_last_rank) == (30.0, "dp", 2)
    assert round(row.bandwidth[DP.group_id].mb_s) == 2000  # 4 MB in 2 ms
    log = row.as_log()
    assert log["ccld/step"] == 0 and log["ccld/per_step/blocked_dp_ms"] == 20.0
    # Rank 3 has not finished step 1 yet: no row until it has.
    partial = dict(v1.summaries)
    partial[3] = panel_summary(3, [], v1.now_ns + 5)
    assert (
        m.update(
            JobView(summaries=partial, tables=TABLES, now_ns=v1.now_ns, job_start_ns=0, world=4),
            joined_samples(1),
        )
        == []
    )
    late = dict(v1.summaries)
    late[3] = panel_summary(3, [1], v1.now_ns + 10, blocked_us=(0, 0))
    (row1,) = m.update(
        JobView(summaries=late, tables=TABLES, now_ns=v1.now_ns + 10, job_start_ns=0, world=4), []
    )
    assert (row1.step, row1.ranks, row1.time_s, row1.skew_last_rank) == (1, 4, 0.1, 2)
    # Rank 3's time in collectives reported before its step 1 ended counts towards it.
    assert row1.blocked_ms == {"dp": 20.0, "tp": 10.0}


def test_a_rank_not_heard_from_yet_holds_the_step_back():
    # Only ranks 0-2's summaries came in this round (rank 3's agent is a round late): a
    # row of three ranks would compare rank 2 with the wrong cohort; wait for rank 3.
    m = PanelMetrics()
    now = 2 * STEP_NS
    sums = {r: panel_summary(r, [0], now) for r in range(4)}
    early = {r: s for r, s in sums.items() if r != 3}
    assert m.update(job_view(early, TABLES, now, world=4), []) == []
    (row,) = m.update(job_view(sums, TABLES, now + 1, world=4), [])
    assert (row.step, row.ranks) == (0, 4)
    # A rank whose process is gone holds nothing back.
    sums = {r: panel_summary(r, [0, 1], now + 2) for r in range(3)}
    (row,) = m.update(job_view(sums, TABLES, now + 2, world=4, gone={3}), [])
    assert (row.step, row.ranks) == (1, 3)


def test_blocked_time_is_shared_among_the_steps_of_apanel_summary():
    m = PanelMetrics()
    now = 3 * STEP_NS
    sums = {r: panel_summary(r, [0, 1], now, blocked_us=(40_000, 0)) for r in range(4)}
    rows = m.update(job_view(sums, TABLES, now, world=4), [])
    assert [(r.step, r.blocked_ms) for r in rows] == [(0, {"dp": 20.0}), (1, {"dp": 20.0})]


def test_sparse_step_numbers_and_the_flush_at_the_end():
    m = PanelMetrics()
    now = 50 * STEP_NS
    sums = {r: panel_summary(r, [0, 10, 20] if r != 1 else [0, 10], now) for r in range(4)}
    view = job_view(sums, TABLES, now, world=4)
    assert [r.step for r in m.update(view, [])] == [0, 10]  # rank 1 has not finished 20
    (last,) = m.flush()  # the job is ending: what some ranks finished is shown too
    assert (last.step, last.ranks) == (20, 3)
    assert m.flush() == []


def test_rank_table_heatmap_and_bandwidth_history():
    m = PanelMetrics()
    for i, v in enumerate(job_views(6)):
        m.update(v, joined_samples(i))
    rows = {r.rank: r for r in m.rank_rows(4)}
    assert rows[2].compute_ms == 120.0 and rows[2].ratio == 2.0 and rows[0].ratio == 1.0
    assert rows[2].last_share == 1.0 and rows[2].wait_ms == 0.0 and rows[0].wait_ms == 15.0
    assert rows[1].bandwidth == {"dp": 2000.0, "tp": 1000.0}
    assert rows[3].bandwidth == {"dp": 2000.0} and rows[3].host == "h1"
    assert rows[0].as_row(["dp", "tp"])[-2:] == [2000.0, 1000.0]
    hist = m.bandwidth_history()
    assert hist[DP.group_id][1] == [0, 1, 2, 3, 4, 5] and group_key(DP) == "dp_0_3"
    mat, ranks, steps = m.compute_matrix(4)
    assert ranks == [0, 1, 2, 3] and steps == [2, 3, 4, 5]
    assert mat.shape == (4, 4) and (mat[2] == 120).all() and (mat[0] == 60).all()
    # A last step that rank 3 has not reported yet is left out rather than drawn grey.
    now = 7 * STEP_NS
    m.update(
        JobView(
            summaries={r: panel_summary(r, [6], now) for r in range(3)},
            tables=TABLES,
            now_ns=now,
            job_start_ns=0,
            world=4,
        ),
        [],
    )
    assert m.compute_matrix(4)[2] == [2, 3, 4, 5]
    rgb = heatmap_rgb(mat)
    assert (rgb[2] == [165, 0, 38]).all()  # twice the step's median: the darkest red
    assert (rgb[0] == [247, 247, 247]).all()  # at the median: white


def test_heatmap_bins_large_worlds_keeping_the_straggler():
    mat = np.full((2000, 3), 10.0)
    mat[1234] = 25.0
    mat[5, 1] = np.nan
    rgb = heatmap_rgb(mat, max_rows=500)
    assert rgb.shape == (500, 3, 3)
    assert (rgb[1234 // 4] == [165, 0, 38]).all()
    assert (rgb[1, 1] == [247, 247, 247]).all()  # a bin with one missing rank still shows


def _png_pixels(png: bytes) -> np.ndarray:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos : pos + 4])
        kind, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + n]
        assert struct.unpack(">I", png[pos + 8 + n : pos + 12 + n])[0] == zlib.crc32(kind + data)
        if kind == b"IHDR":
            w, h = struct.unpack(">II", data[:8])
            assert data[8:10] == b"\x08\x02"  # 8-bit RGB
        idat += data if kind == b"IDAT" else b""
        pos += 12 + n
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, 3)


def test_png_encoder_round_trips():
    rgb = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    assert (_png_pixels(encode_png(rgb)) == rgb).all()


def test_hang_watch_names_the_oldest_op_and_its_threshold():
    now = 50 * S
    flight = [InFlightOp(0, OP_CODES["all_reduce"], 0, -1, 9, 64, now - 7 * S)]
    sums = {r: panel_summary(r, [], now, flights=flight if r != 2 else ()) for r in range(4)}
    sums[1].in_flight[0] = InFlightOp(0, OP_CODES["all_reduce"], 0, -1, 9, 64, now - 8 * S)
    w = hang_watch(
        job_view(sums, TABLES, now, world=4),
        lambda gid: 10.0 if gid == DP.group_id else 0.0,
    )
    assert (w.oldest_rank, w.role, w.op, w.threshold_s, w.blocked_ranks) == (
        1,
        "dp",
        "all_reduce",
        10.0,
        3,
    )
    assert w.oldest_age_s == 8.0 and w.time_s == 50.0
    assert w.as_log()["ccld/hang/oldest_op_age_s"] == 8.0


def test_joined_since_hands_on_each_kept_collective_once(monkeypatch: pytest.MonkeyPatch):
    # What the sink takes from the slow detector each round: the collectives joined since
    # it last took, of those the detector still keeps (it keeps the last MAX_JOINED).
    from ccld_plugin.diagnose import slow
    from ccld_plugin.diagnose.arrivals import JoinedTable

    monkeypatch.setattr(slow, "MAX_JOINED", 5)
    det = slow.SlowDetector(DiagnoserConfig())

    def feed(seqs: range) -> None:
        base = joined_samples(0)[0]
        det.keep_joined(JoinedTable.of([base._replace(seq=q) for q in seqs]))

    def seqs(table: JoinedTable) -> list[int]:
        return [j.seq for j in table]

    feed(range(1, 4))
    got, taken = det.joined_since(0)
    assert seqs(got) == [1, 2, 3]
    feed(range(4, 7))
    got, taken = det.joined_since(taken)
    assert seqs(got) == [4, 5, 6]
    got, taken = det.joined_since(taken)
    assert seqs(got) == []
    feed(range(7, 13))
    got, taken = det.joined_since(taken)
    assert seqs(got) == [8, 9, 10, 11, 12]  # 7 was evicted already: all that are kept are new


def test_verdict_row_has_every_field():
    row = dict(zip(VERDICT_COLUMNS, verdict_row(slow_link_verdict().to_dict()), strict=True))
    fields = set(slow_link_verdict().to_dict()) - {"group"}
    assert fields <= set(row) and {"group_role", "group_ranks", "group_id"} <= set(row)
    assert (row["kind"], row["ranks"], row["link"], row["group_ranks"]) == (
        "slow",
        "[3]",
        "[2, 3]",
        "[0, 1, 2, 3]",
    )
    assert row["evidence"] == "dp[0, 1, 2, 3] moves 1.0 MB/s\nsecond line"
    assert row["stack"] is None and row["schema"] == VERDICT_SCHEMA_VERSION == 3
    assert (row["ratio"], row["stuck_s"]) == (3.1, None)  # a slow verdict's measure, named


def test_verdict_row_and_alert_say_who_and_where():
    v = slow_link_verdict()
    where = {3: Culprit(3, "node-b", 1, Device(0, "GPU-1234"))}
    v.stamp("4242", 7, datetime(2026, 12, 7, 20, 5, 23, 123456, timezone.utc), where.get)
    record = v.to_dict()
    row = dict(zip(VERDICT_COLUMNS, verdict_row(record), strict=True))
    assert row["culprits"] == "rank 3 on node-b (local rank 1, cuda:0 GPU-1234)"
    assert (row["job"], row["time"], row["id"]) == ("4242", "2026-12-07T20:05:23.123Z", v.id)
    text = alert_message(record)["text"]
    assert "rank 3 on node-b (local rank 1, cuda:0 GPU-1234)" in text
    assert f"job 4242, at 2026-12-07T20:05:23.123Z, id {v.id}" in text


def test_disabled_mode_and_no_sink_when_off(monkeypatch):
    assert not [s for s in build_sinks(load_config(None, ["sinks.console=false"]).sinks)]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = WandbSink(WandbConfig(enabled=True))
    view = job_views(1)[0]
    sink.observe(view, Analyzer(DiagnoserConfig(), 0.5))
    sink.close()
    assert sink._dead and sink._backend is None


def test_rank_table_shows_a_rank_queued_for_a_cpu_apart_from_its_time_in_collectives():
    m = PanelMetrics()
    for i, v in enumerate(job_views(6, queued_rank=3)):
        m.update(v, joined_samples(i))
    rows = {r.rank: r for r in m.rank_rows(4)}
    assert (rows[3].cpu_wait_ms, rows[3].blocked_ms) == (10.0, 30.0)  # 100 - 60 - 10
    assert (rows[0].cpu_wait_ms, rows[0].blocked_ms) == (0.0, 40.0)
    columns = rows[3].columns(["dp"])
    assert rows[3].as_row(["dp"])[columns.index("cpu_wait_ms")] == 10.0
