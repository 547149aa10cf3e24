"""``ccld replay``: a recorded job's diagnosis again (``diagnoser.record``): a fresh analyzer
through the recorded rounds, with the job's config or another, and the verdicts it gives."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import yaml

from ccld_plugin.config import CcldConfig, ConfigError, load_config
from ccld_plugin.diagnose import Analyzer, JobView, Verdict
from ccld_plugin.diagnose.analyzer import located_by_channels
from ccld_plugin.diagnose.view import topology_of
from ccld_plugin.postmortem.diagnose_boards import stamp
from ccld_plugin.recording import RecordedRound, RecordingError, read_recording
from ccld_plugin.topology import GroupInfo, Topology
from ccld_plugin.wire.summary_batch import SummaryTable

__all__ = ["replay", "round_views"]


def _known(values: dict, schema: dict) -> dict:
    """``values`` without the keys ``schema`` does not have (at every level)."""
    return {
        k: _known(v, schema[k]) if isinstance(v, dict) and isinstance(schema[k], dict) else v
        for k, v in values.items()
        if k in schema
    }


def replay(
    path: Path, config: Path | None = None, overrides: Iterable[str] = ()
) -> tuple[CcldConfig, list[Verdict]]:
    """The config the replay ran with (the recording's, else ``config``; ``overrides`` on
    top) and every verdict of the recorded rounds, in order."""
    recorded, rounds = read_recording(path)
    if config is not None:
        cfg = load_config(config, overrides, writing=False)
    else:  # recorded by another version: its keys that this one does not know are left out
        values = _known(_recorded_config(path, recorded), dataclasses.asdict(CcldConfig()))
        try:
            load_config(values, writing=False)
        except ConfigError as exc:  # (a bad override is the user's: said as it is, below)
            raise RecordingError(f"{path}: its recorded config is refused: {exc}") from None
        cfg = load_config(values, overrides, writing=False)
    analyzer = Analyzer(cfg.diagnoser, cfg.agent.interval_s, located_by_channels)
    verdicts: list[Verdict] = []
    for _, view in round_views(rounds):
        new = analyzer.round(view)
        stamp(new, view, cfg.job or None, None)  # a recording keeps no wall clock
        verdicts += new
    return cfg, verdicts


def _recorded_config(path: Path, text: str) -> dict:
    """The config a recording holds, as the mapping its YAML is."""
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RecordingError(f"{path}: its recorded config is not YAML ({why})") from None
    if not isinstance(values, dict):
        raise RecordingError(f"{path}: its recorded config is not YAML keys")
    return values


def round_views(rounds: Iterable[RecordedRound]) -> Iterator[tuple[RecordedRound, JobView]]:
    """Each recorded round with the view it gave its diagnoser: its summaries as decoded,
    of the ranks whose group tables it had read, and the topology of its tables."""
    tables: dict[int, list[GroupInfo]] | None = None
    topology = Topology()
    for r in rounds:
        table, _ = SummaryTable.decode(r.values)  # recorded as they decoded live
        listed = np.isin(table.ranks, list(r.tables))
        if not listed.all():  # as live: a rank is in once its group table is read
            table = table.select(listed)
        if r.tables is not tables:
            tables, topology = r.tables, topology_of(r.tables)
        yield (
            r,
            JobView(
                summaries=table,
                tables=r.tables,
                now_ns=r.now_ns,
                job_start_ns=r.job_start_ns,
                world=r.world,
                gone=r.gone,
                topology=topology,
                observer=r.observer,
                store_local=r.store_local,
                store_failed=r.store_failed,
                reach=r.reach,
                observer_load=r.observer_load,
                observer_round_ns=r.observer_round_ns,
            ),
        )
