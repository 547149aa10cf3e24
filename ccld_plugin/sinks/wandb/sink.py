"""The W&B sink: the diagnosis as panels next to the user's loss curves.

Runs on the diagnoser rank. Each round the diagnoser hands it the round's view
(``observe``) and every new verdict (``emit``); both only queue, and a thread of the sink
turns them into panels under ``ccld/`` and writes them out:

- ``ccld/per_step/*`` (x-axis ``ccld/step``): step time, compute time, time blocked per
  group role, worst arrival skew and who arrived last, slowest rank and its ratio to its
  cohort;
- ``ccld/hang/*`` (x-axis ``ccld/time_s``, per round, since a hang stops the steps):
  age of the oldest in-flight op against its hang threshold;
- ``ccld/bandwidth/*``: transfer bandwidth per group, and a line chart per role with one
  series per group;
- ``ccld/ranks/*`` every ``log_interval_steps``: a per-rank table and a bar chart;
- ``ccld/heatmap/compute``: a rank x step picture of compute time;
- ``ccld/verdicts/*``: a table with every verdict field, and ``run.alert`` per verdict;
- the file ``ccld_trace.json``: the job's timeline (what ``ccld trace`` writes from the
  boards, with the run's verdicts on it), attached when the run ends, when the sink is
  given the job's board directory (``boards``).

Where it writes: into the process's existing run when there is one (``wandb.run``, which
Megatron's and DeepSpeed's W&B writers also set), else into a run of its own, owned by a
separate writer process (:mod:`ccld_plugin.sinks.wandb.worker`) so that the run survives
the end of a hung job and wandb's start-up never runs in the training process. Every
failure, wandb missing included, is contained: reported once, and the sink goes quiet.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from ccld_plugin.config import WandbConfig
from ccld_plugin.diagnose.records import Verdict
from ccld_plugin.errors import report_error
from ccld_plugin.sinks.wandb.backends import AttachedRun, Backend, WandbUnavailable, WriterProcess
from ccld_plugin.sinks.wandb.heatmap import heatmap_panel
from ccld_plugin.sinks.wandb.panels import (
    HangWatch,
    PanelMetrics,
    StepRow,
    group_key,
    group_label,
    hang_watch,
)
from ccld_plugin.sinks.wandb.verdicts import VERDICT_COLUMNS, alert_message, verdict_row

__all__ = ["WandbSink"]

# Rounds waiting for the sink's thread; beyond it the oldest are dropped. A view holds
# every rank's summary, so a long queue would cost real memory on a large job.
MAX_QUEUE = 8
MAX_EARLY_OPS = 512  # messages kept while deciding which run to log into
OPEN_AFTER_S = 30.0  # decide even if no step has been marked by then
HEATMAP_STEPS = 100
MAX_SERIES = 32  # groups per role drawn as their own series
MAX_TABLE_ROWS = 4096  # per-rank table: beyond this, the ranks furthest above their cohort
MAX_BARS = 256  # bar chart: beyond this, the ranks with the most compute


def _top(rows: list, n: int, key: Any) -> list:
    """At most ``n`` rows, the highest by ``key``, back in rank order."""
    if len(rows) <= n:
        return rows
    return sorted(sorted(rows, key=key, reverse=True)[:n], key=lambda r: r.rank)


class WandbSink:
    def __init__(
        self, cfg: WandbConfig, python: str = sys.executable, boards: Path | None = None
    ) -> None:
        self.cfg = cfg
        self.python = python
        self.boards = boards  # the job's board directory: its timeline is attached at the end
        self.metrics = PanelMetrics()
        self.dropped = 0  # rounds dropped because the sink's thread fell behind
        self._queue: deque[tuple] = deque()
        self._cv = threading.Condition()
        self._joined_taken = 0  # the slow detector's joined collectives handed on so far
        self._backend: Backend | None = None
        self._dead = False
        self._early: deque[dict] = deque(maxlen=MAX_EARLY_OPS)
        self._first_round: float | None = None
        self._world = 0
        self._last_panel_step: int | None = None
        self._series: dict[str, list[int]] = {}  # role -> group ids drawn as series
        self._verdicts: list[list] = []
        self._thread = threading.Thread(target=self._run, name="ccld-wandb", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- diagnoser side
    def observe(self, view: Any, analyzer: Any, round_s: float = 0.0) -> None:
        """Queue one round (called on the diagnoser thread: only cheap work here; its
        time, ``round_s``, is not drawn)."""
        if self._dead:
            return
        slow = getattr(analyzer, "slow", None)
        joined: Any = ()
        if slow is not None:  # columns here; made into objects on the sink's thread
            joined, self._joined_taken = slow.joined_since(self._joined_taken)
        # The threshold reads the analyzer's history, so it is taken on its thread.
        watch = hang_watch(view, getattr(analyzer, "threshold_s", None))
        self._put(("round", view, joined, watch))

    def emit(self, verdict: Verdict) -> None:
        if not self._dead:
            self._put(("verdict", verdict.to_dict()))

    def close(self) -> None:
        """Write what is left and finish the run (waits at most ``finish_timeout_s``)."""
        self._put(("close",))
        self._thread.join(timeout=self.cfg.finish_timeout_s + 5)

    def _put(self, item: tuple) -> None:
        with self._cv:
            if item[0] == "round" and sum(i[0] == "round" for i in self._queue) >= MAX_QUEUE:
                # Falling behind: drop the oldest round (its summary is usually read
                # again in the next round anyway), never a verdict.
                for i, queued in enumerate(self._queue):
                    if queued[0] == "round":
                        del self._queue[i]
                        self.dropped += 1
                        break
            self._queue.append(item)
            self._cv.notify()

    # -------------------------------------------------------------- the sink's thread
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                item = self._queue.popleft()
            try:
                if item[0] == "close":
                    self._close()
                    return
                if not self._dead:
                    self._handle(item)
            except Exception as exc:  # noqa: BLE001
                report_error("sinks.wandb", exc)
                if isinstance(exc, WandbUnavailable):
                    self._dead = True

    def _handle(self, item: tuple) -> None:
        msgs: list[dict] = []
        if item[0] == "round":
            _, view, joined, watch = item
            self._world = max(self._world, view.world)
            if self._first_round is None:
                self._first_round = time.monotonic()
            rows = self.metrics.update(view, joined)
            msgs += self._step_msgs(rows)
            msgs.append(self._hang_msg(watch))
            due = bool(rows) or time.monotonic() - self._first_round > OPEN_AFTER_S
        else:
            msgs += self._verdict_msgs(item[1])
            # A verdict often means the job will not get further (a hung job is killed
            # and never reaches close()): draw the periodic panels now too.
            if self.metrics.rows:
                msgs += self._panel_msgs(self.metrics.rows[-1].step)
            due = True
        self._send(msgs, open_now=due)

    def _close(self) -> None:
        if self._dead:
            return
        try:
            rows = self.metrics.flush()
            msgs = self._step_msgs(rows)
            if self.metrics.rows:
                msgs += self._panel_msgs(self.metrics.rows[-1].step)
            self._send(msgs, open_now=True)
        except Exception as exc:  # noqa: BLE001
            report_error("sinks.wandb", exc)
        if self._backend is not None:
            self._backend.close(self.cfg.finish_timeout_s)

    def _send(self, msgs: list[dict], open_now: bool) -> None:
        if self._backend is None:
            self._early.extend(msgs)
            if not open_now:
                return
            try:
                self._backend = self._open()
            except WandbUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. the writer could not be started
                raise WandbUnavailable(
                    f"the W&B writer could not start: {type(exc).__name__}: {exc}"
                ) from None
            if self._backend is None:
                return
            msgs = [*self._define_msgs(), *self._timeline_msgs(), *self._early]
            self._early.clear()
        if msgs and self._backend is not None:
            self._backend.send(msgs)

    def _open(self) -> Backend | None:
        """Decide where to log, once: the first time there is something worth logging,
        which gives the user's own ``wandb.init`` time to have run."""
        mode = os.environ.get("WANDB_MODE") or self.cfg.mode
        if mode == "disabled":
            self._dead = True
            return None
        wb = sys.modules.get("wandb")  # never imported here unless the user did
        run = getattr(wb, "run", None) if wb is not None else None
        if run is not None:
            return AttachedRun(wb, run)
        try:
            found = importlib.util.find_spec("wandb") is not None
        except (ImportError, ValueError) as exc:
            raise WandbUnavailable(
                f"wandb cannot be imported: {type(exc).__name__}: {exc}"
            ) from None
        if not found:
            raise WandbUnavailable(
                "wandb cannot be imported: ModuleNotFoundError: No module "
                "named 'wandb' (pip install wandb)"
            )
        kwargs = {
            "project": self.cfg.project,
            "entity": self.cfg.entity,
            "name": self.cfg.run_name,
            "mode": mode,
            "dir": self.cfg.dir,
            "job_type": "ccld",
            "config": {"ccld_world": self._world},
        }
        return WriterProcess({k: v for k, v in kwargs.items() if v is not None}, self.python)

    # -------------------------------------------------------------- panels
    @staticmethod
    def _define_msgs() -> list[dict]:
        by_step = ["ccld/per_step/*", "ccld/bandwidth/*", "ccld/ranks/*", "ccld/heatmap/*"]
        by_time = ["ccld/hang/*", "ccld/verdicts/*"]
        return [
            {"op": "define", "name": "ccld/step"},
            {"op": "define", "name": "ccld/time_s"},
            *({"op": "define", "name": n, "step_metric": "ccld/step"} for n in by_step),
            *({"op": "define", "name": n, "step_metric": "ccld/time_s"} for n in by_time),
            {
                "op": "define",
                "name": "ccld/hang/oldest_op_age_s",
                "step_metric": "ccld/time_s",
                "summary": "max",
            },
        ]

    def _timeline_msgs(self) -> list[dict]:
        if self.boards is None:
            return []
        return [{"op": "timeline", "boards": str(self.boards), "python": self.python}]

    def _step_msgs(self, rows: list[StepRow]) -> list[dict]:
        msgs = []
        for row in rows:
            data: dict[str, Any] = row.as_log()
            by_role: dict[str, list[float]] = {}
            for gid, rate in row.bandwidth.items():
                by_role.setdefault(rate.group.role, []).append(rate.mb_s)
                if gid in self._series_of(rate.group):
                    data[f"ccld/bandwidth/{group_key(rate.group)}_MBps"] = round(rate.mb_s, 3)
            for role, values in by_role.items():
                data[f"ccld/bandwidth/{role}_min_MBps"] = round(min(values), 3)
                data[f"ccld/bandwidth/{role}_median_MBps"] = round(statistics.median(values), 3)
            msgs.append({"op": "log", "data": data})
            last = self._last_panel_step
            if last is None or row.step - last >= self.cfg.log_interval_steps:
                msgs += self._panel_msgs(row.step)
        return msgs

    def _series_of(self, g: Any) -> list[int]:
        series = self._series.setdefault(g.role, [])
        if g.group_id not in series and len(series) < MAX_SERIES:
            series.append(g.group_id)
        return series

    def _hang_msg(self, watch: HangWatch) -> dict:
        return {"op": "log", "data": watch.as_log()}

    def _panel_msgs(self, step: int) -> list[dict]:
        """The periodic panels: per-rank table and bar chart, heatmap, bandwidth lines."""
        self._last_panel_step = step
        n = self.cfg.log_interval_steps
        ranks = self.metrics.rank_rows(n)
        data: dict[str, Any] = {"ccld/step": step}
        if ranks:
            roles = sorted({r for row in ranks for r in row.bandwidth})
            shown = _top(ranks, MAX_TABLE_ROWS, lambda r: r.ratio or 0.0)
            data["ccld/ranks/table"] = {
                "_ccld": "table",
                "columns": ranks[0].columns(roles),
                "data": [r.as_row(roles) for r in shown],
            }
            bars = _top(ranks, MAX_BARS, lambda r: r.compute_ms)
            data["ccld/ranks/compute_bar"] = {
                "_ccld": "bar",
                "columns": ["rank", "compute_ms"],
                "data": [[str(r.rank), round(r.compute_ms, 3)] for r in bars],
                "label": "rank",
                "value": "compute_ms",
                "title": f"compute ms per step by rank (median of the last {n} steps)",
            }
        for role, (xs, ys, keys) in self._bandwidth_lines().items():
            data[f"ccld/bandwidth/{role}_by_group"] = {
                "_ccld": "lines",
                "xs": xs,
                "ys": ys,
                "keys": keys,
                "xname": "step",
                "title": f"{role} transfer bandwidth (MB/s), one line per group",
            }
        msgs = [{"op": "log", "data": data}]
        png = self._heatmap(data)
        if png is not None:
            msgs.append(
                {"op": "file", "name": "ccld_heatmap.png", "b64": base64.b64encode(png).decode()}
            )
        return msgs

    def _bandwidth_lines(self) -> dict[str, tuple[list, list, list]]:
        out: dict[str, tuple[list, list, list]] = {}
        for gid, (g, xs, ys) in self.metrics.bandwidth_history().items():
            if gid in self._series.get(g.role, ()):
                lx, ly, lk = out.setdefault(g.role, ([], [], []))
                lx.append(xs)
                ly.append(ys)
                lk.append(group_label(g))
        return out

    def _heatmap(self, data: dict) -> bytes | None:
        m, ranks, steps = self.metrics.compute_matrix(HEATMAP_STEPS)
        if not m.size:
            return None
        png, page = heatmap_panel(m, ranks, steps)
        data["ccld/heatmap/compute"] = {"_ccld": "html", "html": page}
        return png

    def _verdict_msgs(self, v: dict) -> list[dict]:
        self._verdicts.append(verdict_row(v))
        table = {"_ccld": "table", "columns": VERDICT_COLUMNS, "data": list(self._verdicts)}
        return [
            {
                "op": "log",
                "data": {
                    "ccld/time_s": v.get("detected_s") or 0.0,
                    "ccld/verdicts/table": table,
                    "ccld/verdicts/count": len(self._verdicts),
                },
            },
            # Also in the summary: in someone else's run a history row is only written
            # when they next log, which a hung job never does.
            {"op": "summary", "data": {"ccld/verdicts/table": table}},
            alert_message(v),
            {"op": "verdict", "record": v},  # marked on the timeline
        ]
