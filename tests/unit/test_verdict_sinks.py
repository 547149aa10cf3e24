"""The sinks operators hook into, each against the real thing on loopback: functions given
to ``ccld_plugin.on_verdict``; a sink an installed package declares (a real distribution's
metadata on sys.path, found by importlib.metadata); the webhook against a local
``http.server`` (retries, a server that does not answer, one that refuses); ``/metrics``
scraped over HTTP and read with prometheus_client's own parser."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from builders import S, group, job_view, peer_channel, rank_summary
from paths import REPO
from prometheus_client.parser import text_string_to_metric_families
from sink_package import install_sink_package

import ccld_plugin
from ccld_plugin.config import DiagnoserConfig, PrometheusConfig, SinksConfig, WebhookConfig
from ccld_plugin.diagnose import Analyzer
from ccld_plugin.diagnose.records import Cause, Culprit, Kind, Verdict
from ccld_plugin.errors import contained_errors
from ccld_plugin.sinks import CallbackSink, build_sinks, close_sinks, hooks
from ccld_plugin.sinks.hooks import PluginSink
from ccld_plugin.sinks.prometheus import PrometheusSink
from ccld_plugin.sinks.webhook import WebhookSink
from ccld_plugin.wire.peer_channels import encode_channels
from ccld_plugin.wire.summary import StepStat

DP = group("dp", [0, 1, 2, 3])
WHEN = datetime(2026, 12, 7, 20, 5, 23, tzinfo=timezone.utc)


def _verdict(kind: Kind = Kind.HANG, rank: int = 2, measure: float = 4.0) -> Verdict:
    v = Verdict(
        kind=kind,
        cause=Cause.COMPUTE,
        ranks=[rank],
        group=DP.to_dict(),
        op="all_reduce",
        trace_id=f"{DP.group_id:016x}:7",
        severity=measure,
    )
    v.stamp("4242", 1, WHEN, lambda r: Culprit(r, f"node-{r}", r))
    return v


@pytest.fixture
def callbacks():
    """The module's registry of on_verdict functions, emptied after the test."""
    yield hooks._callbacks
    hooks._callbacks.clear()


def test_on_verdict_functions_get_each_record_on_a_thread_of_their_own(callbacks):
    got: list[dict] = []
    release = threading.Event()

    @ccld_plugin.on_verdict
    def slow(record: dict) -> None:
        release.wait(10)  # a hook that takes its time ...
        got.append(record)

    def broken(record: dict) -> None:
        raise RuntimeError("a hook's own bug")

    ccld_plugin.on_verdict(broken)
    sink = CallbackSink()
    v = _verdict()
    started = time.monotonic()
    sink.emit(v)
    assert time.monotonic() - started < 1  # ... holds up no diagnoser round
    key = f"sinks.on_verdict.{broken.__qualname__}"
    before = contained_errors().get(key, 0)
    release.set()
    sink.close()
    assert got == [v.to_dict()]
    assert contained_errors()[key] == before + 1  # said once, counted; the others run
    with pytest.raises(TypeError, match="takes a function"):
        ccld_plugin.on_verdict("not a function")  # type: ignore[arg-type]


def test_a_sink_an_installed_package_declares_gets_every_verdict(tmp_path, monkeypatch):
    install_sink_package(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    out = tmp_path / "sink.txt"
    monkeypatch.setenv("CCLD_TEST_SINK_FILE", str(out))
    before = contained_errors().get("sinks.plugin.broken", 0)
    sinks = build_sinks(SinksConfig(console=False))
    assert [s.name for s in sinks if isinstance(s, PluginSink)] == ["to_file"]
    assert contained_errors()["sinks.plugin.broken"] == before + 1  # said, left out
    for s in sinks:
        s.emit(_verdict())
    close_sinks(sinks)
    lines = out.read_text().splitlines()
    assert [json.loads(lines[0])["id"], lines[1]] == [_verdict().id, "closed"]
    # turned off: no sink of any package
    assert not [s for s in build_sinks(SinksConfig(console=False, plugins=False))]


class _Server:
    """An HTTP server on 127.0.0.1 that answers each POST with the next status of
    ``statuses`` (then 200), or holds it ``hold_s`` first; the bodies it got."""

    def __init__(self, statuses: list[int] = (), hold_s: float = 0.0) -> None:
        self.statuses, self.bodies = list(statuses), []
        self.hold_s = hold_s
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(server.hold_s)
                status = server.statuses.pop(0) if server.statuses else 200
                server.bodies.append((status, self.headers["Content-Type"], body))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/ccld"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _wait_for(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_webhook_posts_each_verdict_and_retries_a_server_that_fails():
    server = _Server(statuses=[503, 500])
    try:
        sink = WebhookSink(WebhookConfig(url=server.url, timeout_s=5, retries=3))
        v = _verdict()
        sink.emit(v)
        _wait_for(lambda: sink.delivered == 1)  # after two failures, 1 s and 2 s apart
        assert [(s, t) for s, t, _ in server.bodies] == [
            (503, "application/json"),
            (500, "application/json"),
            (200, "application/json"),
        ]
        assert json.loads(server.bodies[-1][2]) == v.to_dict()
        sink.close()
    finally:
        server.close()


def test_the_webhook_gives_up_in_bounded_time_and_never_holds_up_a_round():
    server = _Server(statuses=[400], hold_s=0.0)  # refused: not worth a retry
    before = contained_errors().get("sinks.webhook", 0)
    try:
        sink = WebhookSink(WebhookConfig(url=server.url, timeout_s=1, retries=3))
        sink.emit(_verdict())
        _wait_for(lambda: contained_errors().get("sinks.webhook", 0) == before + 1)
        assert len(server.bodies) == 1
        # a server that does not answer: each try gives up after timeout_s, the emits
        # return at once, and the job's end waits for it a bounded time
        server.hold_s = 30.0
        started = time.monotonic()
        for k in range(3):
            sink.emit(_verdict(rank=k))
        assert time.monotonic() - started < 0.5
        sink.close()
        assert time.monotonic() - started < 1 * (1 + 3) + 2
    finally:
        server.hold_s = 0.0
        server.close()
    # nothing listens at all: contained, counted
    closed = WebhookSink(WebhookConfig(url=server.url, timeout_s=1, retries=0))
    closed.emit(_verdict())
    _wait_for(lambda: contained_errors().get("sinks.webhook", 0) >= before + 2)
    closed.close()


def _scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    return {
        f.name: [(s.name, s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(text.decode())
    }


def _busy_view(now: int):
    """Ranks 0-3 whose last steps took 100 ms, rank 2's with 80 ms of compute."""
    summaries = [
        rank_summary(
            r,
            now,
            host=f"node-{r}",
            steps=[StepStat(5, now - 200_000_000, 100_000, (80 if r == 2 else 30) * 1000, 0)],
        )
        for r in range(4)
    ]
    return job_view(summaries, {r: [DP] for r in range(4)}, now)


def test_metrics_carry_the_verdicts_the_slowest_ranks_and_links(sockets):
    probe = __import__("socket").socket()
    sockets.append(probe)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    sink = PrometheusSink(PrometheusConfig(port=port, address="127.0.0.1", top_k=2))
    try:
        analyzer = Analyzer(DiagnoserConfig(), 0.5)
        # five ticks of channel reports: rank 1's link to 0 queues, the others move freely
        healthy = {"sent": 6 * 10**6, "rtt_us": 300, "min_rtt_us": 8, "busy_share": 0.03}
        for k in range(5):
            t = 10 * S + k * S // 2
            reports = {
                r: [peer_channel((r + 3) % 4, **healthy)]
                if r != 1
                else [peer_channel(0, sent=2_900_000, rtt_us=20_000, busy_share=0.95)]
                for r in range(4)
            }
            tick = [
                rank_summary(r, t, channels=encode_channels(e, 0.5, len(e)))
                for r, e in reports.items()
            ]
            analyzer.slow.communication.channels.ingest(tick)
        assert "ccld_rank_compute_seconds" not in _scrape(port)  # no round yet
        hang = _verdict()
        sink.emit(hang)
        sink.observe(_busy_view(13 * S), analyzer, 0.012)
        m = _scrape(port)
        assert (
            "ccld_verdicts_total",
            {"kind": "hang", "cause": "compute", "role": "dp"},
            1.0,
        ) in m["ccld_verdicts"]
        culprit = {"id": hang.id, "kind": "hang", "cause": "compute", "rank": "2"}
        assert m["ccld_culprit"] == [
            ("ccld_culprit", {**culprit, "host": "node-2", "role": "dp"}, 1.0)
        ]
        compute = {s[1]["rank"]: s[2] for s in m["ccld_rank_compute_seconds"]}
        assert compute == {"2": 0.08, "0": 0.03}  # the top 2 by compute (ties: lowest rank)
        assert {s[1]["rank"]: s[2] for s in m["ccld_rank_wait_seconds"]}["2"] == pytest.approx(0.02)
        assert ("ccld_job_step_seconds", {"stat": "max"}, 0.1) in m["ccld_job_step_seconds"]
        links = m["ccld_link_seconds_per_megabyte"]
        assert [(s[1]["src"], s[1]["dst"], s[1]["source"]) for s in links][0] == ("1", "0", "tcp")
        assert len(links) == 2 and links[0][2] > 10 * links[1][2]
        assert m["ccld_diagnoser_round_seconds"][0][2] == 0.012
        # the Grafana dashboard in the docs is built on these series
        dashboard = (REPO / "docs" / "grafana" / "ccld-dashboard.json").read_text()
        shown = set(re.findall(r"ccld_[a-z_]+", dashboard)) - {"ccld_verdicts"}
        served = {name for samples in m.values() for name, _, _ in samples}
        assert shown and shown <= served, shown - served
        # rounds of a hung job, whose summaries carry no steps: the last ones stand
        hung = [rank_summary(r, 20 * S, host=f"node-{r}") for r in range(4)]
        sink.observe(job_view(hung, {r: [DP] for r in range(4)}, 20 * S), analyzer, 0.01)
        assert {s[1]["rank"]: s[2] for s in _scrape(port)["ccld_rank_compute_seconds"]} == compute
        # the hang resumed: its culprit series goes; the count stays
        back = _verdict(Kind.RESUMED, measure=9.0)
        sink.emit(back)
        m = _scrape(port)
        assert m["ccld_culprit"] == [] and len(m["ccld_verdicts"]) >= 2
        # at most top_k culprit series, the latest findings'
        for r in range(4):
            sink.emit(_verdict(Kind.SLOW, rank=r, measure=1.5))
        assert sorted(s[1]["rank"] for s in _scrape(port)["ccld_culprit"]) == ["2", "3"]
    finally:
        sink.close()
    with pytest.raises(OSError):
        _scrape(port)  # closed with the diagnoser


def test_a_taken_port_leaves_the_prometheus_sink_out_alone(sockets):
    taken = __import__("socket").socket()
    sockets.append(taken)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    before = contained_errors().get("sinks.prometheus", 0)
    cfg = SinksConfig(console=True, prometheus=PrometheusConfig(port=port, address="127.0.0.1"))
    sinks = build_sinks(cfg)
    assert [type(s).__name__ for s in sinks] == ["ConsoleSink"]
    assert contained_errors()["sinks.prometheus"] == before + 1
