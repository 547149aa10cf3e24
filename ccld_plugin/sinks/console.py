"""One clear line per verdict on the console, with its evidence below it."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ccld_plugin.diagnose.records import Verdict

__all__ = ["ConsoleSink", "render_verdict"]

_STYLE = {
    "hang": "bold red",
    "deadlock": "bold red",
    "mismatch": "bold magenta",
    "unresponsive": "bold red",
    "crash": "bold red",
    "slow": "bold yellow",
    "resumed": "bold green",
}


def render_verdict(v: dict) -> Text:
    """A verdict record (as in verdicts.jsonl) as console text."""
    g = v.get("group") or {}
    where = f" in {g['role']}{g['ranks']}" if g else ""
    what = f" at {v['op']}" if v.get("op") else ""
    ratio = f", {v['ratio']}x slower" if v.get("ratio") else ""
    link = f", link {v['link'][0]}<->{v['link'][1]}" if v.get("link") else ""
    onset = f"onset {v['onset_s']:.1f}s, " if v.get("onset_s") is not None else ""
    step = f"step {v['step']}, " if v.get("step") is not None else ""
    # the culprits' hosts, when one or a few: the node to look at
    hosts = sorted({c["host"] for c in v.get("culprits") or [] if c.get("host")})
    on = f" on {', '.join(hosts)}" if 0 < len(hosts) <= 4 else ""
    when = f", {v['time']}" if v.get("time") else ""
    text = Text()
    text.append(f"[ccld] {v['kind'].upper()} ", style=_STYLE.get(v["kind"], "bold"))
    text.append(
        f"{v['cause']}-bound: rank{'s' if len(v['ranks']) > 1 else ''} "
        f"{', '.join(map(str, v['ranks']))}{on}{where}{what}{link}{ratio} "
        f"({step}{onset}detected {v.get('detected_s', 0):.1f}s{when})"
    )
    for e in v.get("evidence", []):
        text.append(f"\n    - {e['text']}", style="dim")
    for frame in (v.get("stack") or [])[-4:]:
        text.append(f"\n      | {frame}", style="cyan")
    return text


class ConsoleSink:
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)

    def emit(self, verdict: Verdict) -> None:
        self.console.print(render_verdict(verdict.to_dict()))

    def close(self) -> None:
        pass
