"""Render a ``ccld trace`` timeline (Trace Event JSON) as a PNG, for the docs.

The docs' picture of a timeline is drawn from the trace file itself, with no browser, not
taken as a Perfetto screenshot: one row per
track (a rank's steps and each of its groups, as Perfetto shows them), each slice a bar
(an op still in flight at the end hatched), flow arrows joining one collective across
ranks, verdicts as red markers on the culprit's track.

Needs matplotlib (not a dependency of ccld-plugin):

    python tools/render_timeline.py trace.json -o docs/img/hang-timeline.png [--last-s 8]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

COLOURS = {"step": "#c9d6e8", "collective": "#4c78a8", "p2p": "#59a14f"}
IN_FLIGHT = "#e15759"


def _tracks(events: list[dict[str, Any]]) -> list[tuple[int, int, str]]:
    """(pid, tid, label) of every named track, in Perfetto's order."""
    procs: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"].split(" (")[0]
        elif e["ph"] == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return [(p, t, f"{procs.get(p, p)}  {name}") for (p, t), name in sorted(threads.items())]


def render(trace: Path, out: Path, last_s: float | None, title: str) -> None:
    events = json.loads(trace.read_text())["traceEvents"]
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] in ("X", "i")}
    tracks = [t for t in _tracks(events) if t[:2] in used]  # an empty track says nothing
    row = {(p, t): i for i, (p, t, _) in enumerate(tracks)}
    drawn = [e for e in events if e["ph"] in ("X", "i")]
    end = max(e["ts"] + e.get("dur", 0) for e in drawn) / 1e6
    first = min(e["ts"] for e in drawn) / 1e6  # the job's start-up holds nothing to draw
    start = max(first, end - last_s) if last_s else first
    label_min = 0.04 * (end - start)  # a step label fits in a bar this long
    fig, ax = plt.subplots(figsize=(13, 0.42 * len(tracks) + 1.6), dpi=110)
    for e in events:
        if e["ph"] != "X" or (e["pid"], e["tid"]) not in row:
            continue
        t0, dur = e["ts"] / 1e6, e["dur"] / 1e6
        if t0 + dur < start:
            continue
        stuck = e["args"].get("state") == "in_flight"
        ax.broken_barh(
            [(t0, max(dur, 0.004))],
            (row[(e["pid"], e["tid"])] - 0.38, 0.76),
            facecolors=IN_FLIGHT if stuck else COLOURS.get(e["cat"], "#999999"),
            edgecolors="white" if not stuck else "#8b0000",
            linewidth=0.3,
            hatch="///" if stuck else None,
        )
        if e["cat"] == "step" and t0 >= start and dur >= label_min:
            ax.text(t0 + 0.01, row[(e["pid"], e["tid"])], e["name"], va="center", fontsize=6)
    flows: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for e in events:
        if e["ph"] in "stf" and (e["pid"], e["tid"]) in row and e["ts"] / 1e6 >= start:
            flows[e["id"]].append((e["ts"] / 1e6, row[(e["pid"], e["tid"])]))
    for points in flows.values():
        points.sort()
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, color="#555555", linewidth=0.4, alpha=0.6)
    for e in events:
        if e["ph"] == "i" and (e["pid"], e["tid"]) in row:
            x, y = e["ts"] / 1e6, row[(e["pid"], e["tid"])]
            ax.plot([x], [y], marker="v", color="#b00000", markersize=11, zorder=5)
            ax.annotate(
                f"verdict: {e['name']}, rank {e['pid']}",
                (x, y),
                xytext=(8, 10),
                textcoords="offset points",
                fontsize=8,
                color="#b00000",
                fontweight="bold",
            )
    ax.set_yticks(range(len(tracks)), [label for _, _, label in tracks], fontsize=8)
    ax.set_ylim(len(tracks) - 0.5, -0.5)
    ax.set_xlim(start, end + 0.02 * (end - start))
    ax.set_xlabel("seconds since the job started (the diagnoser's clock)")
    ax.set_title(title, fontsize=10)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=COLOURS["step"], label="step"),
        plt.Rectangle((0, 0), 1, 1, color=COLOURS["collective"], label="collective (done)"),
        plt.Rectangle((0, 0), 1, 1, color=COLOURS["p2p"], label="send / recv (done)"),
        plt.Rectangle((0, 0), 1, 1, color=IN_FLIGHT, hatch="///", label="in flight at the end"),
    ]
    ax.legend(handles=handles, loc="lower left", fontsize=7, ncol=4, framealpha=0.9)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("-o", "--output", type=Path, default=Path("timeline.png"))
    p.add_argument("--last-s", type=float, help="only the last seconds of the job")
    p.add_argument("--title", default="ccld trace: a compute hang (rank 2), 4 ranks")
    args = p.parse_args()
    render(args.trace, args.output, args.last_s, args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
