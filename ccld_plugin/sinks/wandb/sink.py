"""The W&B sink: the diagnosis as panels next to the user's loss curves.

Runs on the diagnoser rank. Each round the diagnoser service hands it the round's view
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
- ``ccld/verdicts/*``: a table with every verdict field, and ``run.alert`` per verdict.

Where it writes: into the process's existing run when there is one (``wandb.run``, which
Megatron's and DeepSpeed's W&B writers also set), else into a run of its own, owned by a
separate writer process (:mod:`ccld_plugin.sinks.wandb.worker`) so that the run survives
the end of a hung job and wandb's start-up never runs in the training process. Every
failure, wandb missing included, is contained: reported once, and the sink goes quiet.
"""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import html
import importlib.util
import json
import os
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ccld_plugin.config import WandbConfig
from ccld_plugin.diagnose.records import Verdict
from ccld_plugin.errors import log, report_error
from ccld_plugin.sinks.wandb.panels import (
    HangWatch,
    PanelMetrics,
    StepRow,
    group_key,
    group_label,
    hang_watch,
    take_new_joined,
)
from ccld_plugin.sinks.wandb.worker import Applier, encode_message

__all__ = ["VERDICT_COLUMNS", "WandbSink", "WandbUnavailable", "encode_png", "heatmap_rgb",
           "verdict_row"]

# Rounds waiting for the sink's thread; beyond it the oldest are dropped. A view holds
# every rank's summary, so a long queue would cost real memory on a large job.
MAX_QUEUE = 8
MAX_EARLY_OPS = 512  # messages kept while deciding which run to log into
OPEN_AFTER_S = 30.0  # decide even if no step has been marked by then
HEATMAP_STEPS = 100
HEATMAP_MAX_ROWS = 512  # more ranks than this are binned (the slowest of a bin shows)
MAX_SERIES = 32  # groups per role drawn as their own series
MAX_TABLE_ROWS = 4096  # per-rank table: beyond this, the ranks furthest above their cohort
MAX_BARS = 256  # bar chart: beyond this, the ranks with the most compute
PIPE_SIZE = 1 << 20  # room for what the writer process has not read yet (it starts slowly)
_STUCK_KINDS = {"hang", "deadlock", "unresponsive", "mismatch"}

VERDICT_COLUMNS: list[str] = [
    *(f.name for f in dataclasses.fields(Verdict) if f.name != "group"),
    "group_role", "group_ranks", "group_id", "schema"]


class WandbUnavailable(RuntimeError):
    """W&B cannot be written to (not installed, broken, or its writer died)."""


# ---------------------------------------------------------------------- pictures
def encode_png(rgb: np.ndarray) -> bytes:
    """A minimal PNG encoder (8-bit RGB, no filtering): pillow is not needed."""
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8),
                          np.ascontiguousarray(rgb, np.uint8).reshape(h, w * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + chunk(b"IEND", b""))


# Diverging map over log2(ratio to the step's median): blue 0.5x, white 1x, red 2x+.
_ANCHORS = np.array([[49, 54, 149], [116, 173, 209], [247, 247, 247], [244, 109, 67],
                     [165, 0, 38]], float)
_MISSING = np.array([110, 110, 110], float)


def heatmap_rgb(matrix: np.ndarray, max_rows: int = HEATMAP_MAX_ROWS) -> np.ndarray:
    """Ranks x steps compute times as colours, each relative to its step's median."""
    m = np.where(np.isfinite(matrix), matrix, np.nan)
    med = np.full(m.shape[1], np.nan)
    cols = ~np.isnan(m).all(axis=0)  # all-NaN columns would make nanmedian warn
    if cols.any():
        med[cols] = np.nanmedian(m[:, cols], axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.clip(np.log2(m / np.where(med > 0, med, np.nan)), -1.0, 1.0)
    if t.shape[0] > max_rows:  # bin rows by their worst value, so a straggler stays visible
        k = -(-t.shape[0] // max_rows)
        pad = np.full((k * max_rows - t.shape[0], t.shape[1]), np.nan)
        binned = np.vstack([t, pad]).reshape(max_rows, k, t.shape[1])
        worst = np.where(np.isnan(binned), -np.inf, binned).max(axis=1)
        t = np.where(np.isneginf(worst), np.nan, worst)
    pos = (np.nan_to_num(t, nan=0.0) + 1.0) * 2.0  # 0..4 over the five anchors
    lo = np.clip(np.floor(pos).astype(int), 0, 3)
    frac = (pos - lo)[..., None]
    rgb = _ANCHORS[lo] * (1 - frac) + _ANCHORS[lo + 1] * frac
    rgb[np.isnan(t)] = _MISSING
    return rgb.round().astype(np.uint8)


def _scale(rgb: np.ndarray) -> tuple[np.ndarray, int, int]:
    rows, cols = rgb.shape[:2]
    cw = max(2, min(16, 640 // max(cols, 1)))
    ch = max(2, min(24, 320 // max(rows, 1)))
    return np.repeat(np.repeat(rgb, ch, axis=0), cw, axis=1), cw, ch


def _heatmap_html(png: bytes, ranks: list[int], steps: list[int], ch: int, k: int,
                  slowest: str) -> str:
    src = "data:image/png;base64," + base64.b64encode(png).decode()
    labels = ""
    if k == 1 and ch >= 10 and len(ranks) <= 64:
        labels = "".join(f'<div style="height:{ch}px;line-height:{ch}px">rank {r}</div>'
                         for r in ranks)
        labels = f'<div style="text-align:right;padding-right:4px">{labels}</div>'
    rows = f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "no ranks"
    if k > 1:
        rows += f", {k} ranks per row (the slowest of them)"
    gradient = ",".join(f"rgb({int(a[0])},{int(a[1])},{int(a[2])})" for a in _ANCHORS)
    return (
        '<div style="font-family:sans-serif;font-size:11px">'
        f'<div style="display:flex">{labels}<img src="{src}" '
        'style="image-rendering:pixelated"/></div>'
        f"<div>rows: {html.escape(rows)} (top to bottom); columns: steps "
        f"{steps[0] if steps else '-'}-{steps[-1] if steps else '-'} (left to right)</div>"
        '<div>colour: compute time relative to the step\'s median '
        f'<span style="display:inline-block;width:120px;height:9px;'
        f'background:linear-gradient(to right,{gradient})"></span> 0.5x - 1x - 2x; '
        f"grey: not reported</div><div>{html.escape(slowest)}</div></div>")


def _top(rows: list, n: int, key: Any) -> list:
    """At most ``n`` rows, the highest by ``key``, back in rank order."""
    if len(rows) <= n:
        return rows
    return sorted(sorted(rows, key=key, reverse=True)[:n], key=lambda r: r.rank)


# ---------------------------------------------------------------------- verdicts
def verdict_row(v: dict) -> list:
    """A verdict record as a table row in :data:`VERDICT_COLUMNS` order: lists of numbers
    as JSON, lines of text (evidence, stack) one per line, the group in three columns."""
    g = v.get("group") or {}
    cells = {**v, "group_role": g.get("role"), "group_ranks": g.get("ranks"),
             "group_id": g.get("group_id")}
    row = []
    for col in VERDICT_COLUMNS:
        x = cells.get(col)
        if isinstance(x, list):
            x = "\n".join(map(str, x)) if x and isinstance(x[0], str) else json.dumps(x)
        row.append(x)
    return row


def _alert(v: dict) -> dict:
    g = v.get("group") or {}
    ranks = ", ".join(map(str, v["ranks"]))
    where = f" in {g['role']}{g['ranks']}" if g else ""
    title = f"ccld {v['kind']}: rank {ranks} ({v['cause']})"
    lines = [f"{v['kind']} verdict, {v['cause']}-bound: rank {ranks}{where}"
             + (f" at {v['op']}" if v.get("op") else "")
             + (f", {v['severity']}x" if v.get("severity") and v["kind"] == "slow" else "")
             + f" (step {v.get('step')}, detected {v.get('detected_s')} s)",
             *[f"- {e}" for e in v.get("evidence", [])[:6]]]
    return {"op": "alert", "title": title, "text": "\n".join(lines),
            "level": "ERROR" if v["kind"] in _STUCK_KINDS else "WARN"}


# ---------------------------------------------------------------------- backends
class _Backend(Protocol):
    failure: str | None

    def send(self, msgs: list[dict]) -> None: ...

    def close(self, wait_s: float) -> None: ...


class _Attached:
    """The process's own run: apply in this thread, and leave the run open at close."""

    def __init__(self, wandb: Any, run: Any) -> None:
        self.applier = Applier(wandb, run, attached=True)
        self.failure: str | None = None
        self._failed: set[str] = set()
        log.info("ccld: W&B panels go into the existing run %s", getattr(run, "id", "?"))

    def send(self, msgs: list[dict]) -> None:
        for m in msgs:
            try:
                self.applier.apply(m)
            except Exception as exc:  # noqa: BLE001 - one panel must not stop the others
                report_error(f"sinks.wandb.{m.get('op')}", exc)

    def close(self, wait_s: float) -> None:
        pass


class _Writer:
    """A writer process that owns the run (see :mod:`ccld_plugin.sinks.wandb.worker`)."""

    def __init__(self, init_kwargs: dict, python: str) -> None:
        worker = Path(__file__).with_name("worker.py")
        # Its own session: the launcher's kill of the job's process group must not take
        # it down before it has finished the run.
        self.proc = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)
        try:
            fcntl.fcntl(self.proc.stdin.fileno(), 1031, PIPE_SIZE)  # F_SETPIPE_SZ
        except OSError:
            pass  # the default 64 KiB pipe works too, only with less slack
        self.failure: str | None = None
        self.ready = threading.Event()
        self.run_dir: str | None = None
        self._status = threading.Thread(target=self._read_status, name="ccld-wandb-status",
                                        daemon=True)
        self._status.start()
        self.send([{"op": "init", "kwargs": init_kwargs}])

    def _read_status(self) -> None:
        for line in self.proc.stdout:
            try:
                st = json.loads(line)
            except ValueError:
                continue
            if st.get("ready"):
                self.run_dir = st.get("dir")
                self.ready.set()
            elif st.get("failed"):  # one kind of panel failed; the run goes on
                report_error(f"sinks.wandb.{st['failed']}", WandbUnavailable(st.get("error")))
            elif st.get("error"):
                self.failure = f"the W&B writer could not open a run: {st['error']}"
                report_error("sinks.wandb", WandbUnavailable(self.failure))
        if not self.ready.is_set() and self.failure is None:
            code = self.proc.wait()
            self.failure = f"the W&B writer exited with code {code} before opening a run"
            report_error("sinks.wandb", WandbUnavailable(self.failure))

    def send(self, msgs: list[dict]) -> None:
        if self.failure:
            raise WandbUnavailable(self.failure)
        try:
            self.proc.stdin.write(b"".join(encode_message(m) for m in msgs))
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            self.failure = self.failure or f"the W&B writer is gone ({exc})"
            raise WandbUnavailable(self.failure) from None

    def close(self, wait_s: float) -> None:
        try:
            self.send([{"op": "finish"}])
            self.proc.stdin.close()
        except (WandbUnavailable, OSError):
            pass
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            log.info("ccld: the W&B writer is still finishing the run; it ends on its own")


# ---------------------------------------------------------------------- the sink
class WandbSink:
    def __init__(self, cfg: WandbConfig, python: str = sys.executable) -> None:
        self.cfg = cfg
        self.python = python
        self.metrics = PanelMetrics()
        self.dropped = 0  # rounds dropped because the sink's thread fell behind
        self._queue: deque[tuple] = deque()
        self._cv = threading.Condition()
        self._last_joined: Any = None
        self._backend: _Backend | None = None
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
    def observe(self, view: Any, diagnoser: Any) -> None:
        """Queue one round (called on the diagnoser thread: only cheap work here)."""
        if self._dead:
            return
        slow = getattr(diagnoser, "slow", None)
        joined = take_new_joined(slow.joined, self._last_joined) if slow is not None else []
        if joined:
            self._last_joined = joined[-1]
        # The threshold reads the diagnoser's history, so it is taken on its thread.
        watch = hang_watch(view, getattr(diagnoser, "threshold_s", None))
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
                raise WandbUnavailable(f"the W&B writer could not start: "
                                       f"{type(exc).__name__}: {exc}") from None
            if self._backend is None:
                return
            msgs = [*self._define_msgs(), *self._early]
            self._early.clear()
        if msgs and self._backend is not None:
            self._backend.send(msgs)

    def _open(self) -> _Backend | None:
        """Decide where to log, once: the first time there is something worth logging,
        which gives the user's own ``wandb.init`` time to have run."""
        mode = os.environ.get("WANDB_MODE") or self.cfg.mode
        if mode == "disabled":
            self._dead = True
            return None
        wb = sys.modules.get("wandb")  # never imported here unless the user did
        run = getattr(wb, "run", None) if wb is not None else None
        if run is not None:
            return _Attached(wb, run)
        try:
            found = importlib.util.find_spec("wandb") is not None
        except (ImportError, ValueError) as exc:
            raise WandbUnavailable(f"wandb cannot be imported: {type(exc).__name__}: {exc}") \
                from None
        if not found:
            raise WandbUnavailable("wandb cannot be imported: ModuleNotFoundError: No module "
                                   "named 'wandb' (pip install wandb)")
        kwargs = {"project": self.cfg.project, "entity": self.cfg.entity,
                  "name": self.cfg.run_name, "mode": mode, "dir": self.cfg.dir,
                  "job_type": "ccld", "config": {"ccld_world": self._world}}
        return _Writer({k: v for k, v in kwargs.items() if v is not None}, self.python)

    # -------------------------------------------------------------- panels
    @staticmethod
    def _define_msgs() -> list[dict]:
        by_step = ["ccld/per_step/*", "ccld/bandwidth/*", "ccld/ranks/*", "ccld/heatmap/*"]
        by_time = ["ccld/hang/*", "ccld/verdicts/*"]
        return [{"op": "define", "name": "ccld/step"}, {"op": "define", "name": "ccld/time_s"},
                *({"op": "define", "name": n, "step_metric": "ccld/step"} for n in by_step),
                *({"op": "define", "name": n, "step_metric": "ccld/time_s"} for n in by_time),
                {"op": "define", "name": "ccld/hang/oldest_op_age_s", "step_metric":
                 "ccld/time_s", "summary": "max"}]

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
            data["ccld/ranks/table"] = {"_ccld": "table", "columns": ranks[0].columns(roles),
                                        "data": [r.as_row(roles) for r in shown]}
            bars = _top(ranks, MAX_BARS, lambda r: r.compute_ms)
            data["ccld/ranks/compute_bar"] = {
                "_ccld": "bar", "columns": ["rank", "compute_ms"],
                "data": [[str(r.rank), round(r.compute_ms, 3)] for r in bars],
                "label": "rank", "value": "compute_ms",
                "title": f"compute ms per step by rank (median of the last {n} steps)"}
        for role, (xs, ys, keys) in self._bandwidth_lines().items():
            data[f"ccld/bandwidth/{role}_by_group"] = {
                "_ccld": "lines", "xs": xs, "ys": ys, "keys": keys, "xname": "step",
                "title": f"{role} transfer bandwidth (MB/s), one line per group"}
        msgs = [{"op": "log", "data": data}]
        png = self._heatmap(data)
        if png is not None:
            msgs.append({"op": "file", "name": "ccld_heatmap.png",
                         "b64": base64.b64encode(png).decode()})
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
        rgb = heatmap_rgb(m)
        k = -(-len(ranks) // rgb.shape[0])
        big, _, ch = _scale(rgb)
        png = encode_png(big)
        slowest = ""
        with np.errstate(all="ignore"):
            mean = np.nanmean(m, axis=1)
        if np.isfinite(mean).any():
            i = int(np.nanargmax(mean))
            others = np.delete(mean, i)
            med = float(np.nanmedian(others)) if np.isfinite(others).any() else 0.0
            ratio = f" ({mean[i] / med:.2f}x the median rank)" if med > 0 else ""
            slowest = f"slowest: rank {ranks[i]}, {mean[i]:.1f} ms compute per step{ratio}"
        data["ccld/heatmap/compute"] = {"_ccld": "html",
                                        "html": _heatmap_html(png, ranks, steps, ch, k, slowest)}
        return png

    def _verdict_msgs(self, v: dict) -> list[dict]:
        self._verdicts.append(verdict_row(v))
        table = {"_ccld": "table", "columns": VERDICT_COLUMNS, "data": list(self._verdicts)}
        return [{"op": "log", "data": {"ccld/time_s": v.get("detected_s") or 0.0,
                                       "ccld/verdicts/table": table,
                                       "ccld/verdicts/count": len(self._verdicts)}},
                # Also in the summary: in someone else's run a history row is only written
                # when they next log, which a hung job never does.
                {"op": "summary", "data": {"ccld/verdicts/table": table}},
                _alert(v)]
