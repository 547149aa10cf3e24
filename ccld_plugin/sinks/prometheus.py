"""``/metrics`` from the diagnoser (``sinks.prometheus.port``), with the official
``prometheus_client``, for the Prometheus and Grafana an operator already has.

Series (every family bounded by ``top_k``, never one series per rank or link of the job):

- ``ccld_verdicts_total{kind,cause,role}``: verdicts emitted;
- ``ccld_culprit{id,kind,cause,rank,host,role}``: 1 for each rank a standing finding
  names (a hang's series goes when its ``resumed`` comes), the ``top_k`` latest;
- ``ccld_rank_{step,compute,wait}_seconds{rank,host}``: the last step of the ``top_k``
  ranks with the most compute (wait: time blocked in collectives), and
  ``ccld_job_{step,compute}_seconds{stat="median"|"max"}`` over every rank;
- ``ccld_link_seconds_per_megabyte{src,dst,source}``: the ``top_k`` directed links with
  the most send-queue time per MB over the diagnoser's recent channel window;
- ``ccld_diagnoser_round_seconds``, ``ccld_diagnoser_lag_seconds`` (age of the newest
  summary at the last round), ``ccld_diagnoser_last_round_age_seconds``.

The diagnoser's round only keeps references (``observe``); the numbers are computed when
Prometheus scrapes, on the server's thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ccld_plugin.config import PrometheusConfig
from ccld_plugin.diagnose.links.link_stats import LinkTable, nccl_links, tcp_links
from ccld_plugin.diagnose.records import Kind, Verdict
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.errors import log
from ccld_plugin.wire.peer_channels import ChannelRows

__all__ = ["PrometheusSink"]


class PrometheusSink:
    def __init__(self, cfg: PrometheusConfig) -> None:
        self.cfg = cfg
        self.registry = CollectorRegistry(auto_describe=False)
        self.verdicts = Counter(
            "ccld_verdicts",
            "Verdicts the diagnoser emitted, by kind, cause and the role of their group",
            ["kind", "cause", "role"],
            registry=self.registry,
        )
        self._lock = threading.Lock()
        # finding id -> the label values of its culprits' series, oldest first
        self._culprits: OrderedDict[str, list[tuple[str, ...]]] = OrderedDict()
        self._round: tuple[JobView, tuple[ChannelRows, ...], float, float] | None = None
        # by rank, its last step's (step, compute, wait) seconds (NaN: none seen), and host
        self._steps = np.full((0, 3), np.nan)
        self._hosts: dict[int, str] = {}
        self.registry.register(_Collector(self))
        self.server, self._thread = start_http_server(cfg.port, cfg.address, self.registry)
        log.info("ccld: /metrics on %s:%d", cfg.address, cfg.port)

    def emit(self, verdict: Verdict) -> None:
        g = verdict.group or {}
        role = g.get("role", "none")
        self.verdicts.labels(verdict.kind.value, verdict.cause.value, role).inc()
        with self._lock:
            if verdict.kind is Kind.RESUMED:
                self._culprits.pop(verdict.resumes or "", None)
                return
            self._culprits[verdict.id or ""] = [
                (verdict.id or "", verdict.kind.value, verdict.cause.value, str(c.rank))
                + (c.host or "", role)
                for c in verdict.culprits
            ]
            while sum(map(len, self._culprits.values())) > self.cfg.top_k:
                oldest = next(iter(self._culprits.values()))
                oldest.pop(0)
                if not oldest:
                    self._culprits.popitem(last=False)

    def observe(self, view: JobView, analyzer: Any, round_s: float = 0.0) -> None:
        """Keep the round's view, each rank's last step (a hung rank's summaries carry
        none: its last stands) and the links' recent channel reports (references: the
        analysis makes new ones each round) for the next scrape."""
        batches = tuple(analyzer.slow.communication.channels.batches)
        table = view.columns
        st = table.steps
        with self._lock:
            self._round = (view, batches, round_s, time.monotonic())
            if not len(st):
                return
            order = np.lexsort((st["step"], st["row"]))
            rows = st["row"][order]
            last = order[np.r_[np.flatnonzero(np.diff(rows)), len(rows) - 1]]
            ranks = table.ranks[st["row"][last]]
            if ranks.max() >= len(self._steps):
                grown = np.full((int(ranks.max()) + 1, 3), np.nan)
                grown[: len(self._steps)] = self._steps
                self._steps = grown
            step, compute = st["step_us"][last] / 1e6, st["compute_us"][last] / 1e6
            wait = np.maximum(step - compute - st["cpu_wait_us"][last] / 1e6, 0.0)
            self._steps[ranks] = np.stack([step, compute, wait], axis=1)
            for rank, row in zip(ranks.tolist(), st["row"][last].tolist(), strict=True):
                if rank not in self._hosts:  # once per rank
                    self._hosts[rank] = table.host(row)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -------------------------------------------------------------- scrape
    def families(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            culprits = [labels for series in self._culprits.values() for labels in series]
            last = self._round
            steps, hosts = self._steps.copy(), dict(self._hosts)
        found = GaugeMetricFamily(
            "ccld_culprit",
            "1 for each rank a standing finding names (the latest top_k)",
            labels=["id", "kind", "cause", "rank", "host", "role"],
        )
        for labels in culprits:
            found.add_metric(list(labels), 1)
        yield found
        if last is None:
            return
        view, batches, round_s, at = last
        yield from self._ranks(steps, hosts)
        yield _links(ChannelRows.concat([*batches]), self.cfg.top_k)
        table = view.columns
        newest = int(table.heads["time_ns"].max()) if len(table) else view.now_ns
        for name, value, what in (
            ("round_seconds", round_s, "How long the diagnoser's last round took"),
            ("lag_seconds", (view.now_ns - newest) / 1e9, "Age of the newest summary then"),
            ("last_round_age_seconds", time.monotonic() - at, "Seconds since the last round"),
        ):
            yield GaugeMetricFamily(f"ccld_diagnoser_{name}", what, value=value)

    def _ranks(self, steps: np.ndarray, hosts: dict[int, str]) -> Iterator[GaugeMetricFamily]:
        """Per rank, its last step reported: the top_k by compute, and the job's spread."""
        families = {
            name: GaugeMetricFamily(f"ccld_rank_{name}_seconds", what, labels=["rank", "host"])
            for name, what in (
                ("step", "Last step's time, of the ranks with the most compute"),
                ("compute", "Last step's time outside collectives"),
                ("wait", "Last step's time blocked in collectives"),
            )
        }
        job = {
            name: GaugeMetricFamily(f"ccld_job_{name}_seconds", what, labels=["stat"])
            for name, what in (
                ("step", "Last step's time over the job's ranks"),
                ("compute", "Last step's compute over the job's ranks"),
            )
        }
        ranks = np.flatnonzero(~np.isnan(steps[:, 0]))
        if len(ranks):
            seen = steps[ranks]
            for i in np.argsort(-seen[:, 1], kind="stable")[: self.cfg.top_k].tolist():
                rank = int(ranks[i])
                labels = [str(rank), hosts.get(rank, "")]
                for k, name in enumerate(("step", "compute", "wait")):
                    families[name].add_metric(labels, float(seen[i, k]))
            for k, name in enumerate(("step", "compute")):
                job[name].add_metric(["median"], float(np.median(seen[:, k])))
                job[name].add_metric(["max"], float(seen[:, k].max()))
        yield from families.values()
        yield from job.values()


class _Collector(Collector):
    def __init__(self, sink: PrometheusSink) -> None:
        self.sink = sink

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return self.sink.families()


def _links(rows: ChannelRows, k: int) -> GaugeMetricFamily:
    """The ``k`` directed links with the most send-queue time per MB over ``rows``."""
    family = GaugeMetricFamily(
        "ccld_link_seconds_per_megabyte",
        "Send-queue seconds per MB sent, of the slowest directed links (top_k)",
        labels=["src", "dst", "source"],
    )
    tables: list[tuple[str, LinkTable]] = [("tcp", tcp_links(rows)), ("nccl", nccl_links(rows))]
    links = [
        (spm, src, dst, source)
        for source, t in tables
        for spm, src, dst in zip(t.s_per_mb.tolist(), t.src.tolist(), t.dst.tolist(), strict=True)
    ]
    for spm, src, dst, source in sorted(links, reverse=True)[:k]:
        family.add_metric([str(src), str(dst), source], spm)
    return family
