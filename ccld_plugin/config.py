"""The plugin's configuration: one tree of dataclasses, validated by omegaconf at load.

Each component receives only its own sub-config. Defaults live here (and are mirrored in
``configs/default.yaml``, which a test keeps in sync). Any unknown key or bad value stops
at start-up with a one-line :class:`ConfigError` that names the key, the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "AgentConfig",
    "BoardConfig",
    "CcldConfig",
    "ConfigError",
    "ControlConfig",
    "DiagnoserConfig",
    "SinksConfig",
    "TracerConfig",
    "WandbConfig",
    "load_config",
    "to_yaml",
]


class ConfigError(ValueError):
    """A bad configuration key or value; the message is one line and names the fix."""


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"ccld config: {key}={value!r} is not allowed; expected {allowed}")


@dataclass(kw_only=True)
class BoardConfig:
    dir: str = "/dev/shm/ccld"
    """Boards are written to ``<dir>/<job>/rank<r>.board``."""
    ring_size: int = 4096
    """Op records kept per rank (rounded up to a power of two)."""
    max_groups: int = 256
    """Process groups a rank can register."""
    max_channels: int = 512
    """Channel records (per-peer connection progress) per rank."""
    cleanup: bool = True
    """Remove the board files at normal exit; keep them off for post-mortems."""

    def __post_init__(self) -> None:
        _check(bool(self.dir), "board.dir", self.dir, "a directory path")
        _check(16 <= self.ring_size <= 1 << 20, "board.ring_size", self.ring_size, "16..1048576")
        _check(1 <= self.max_groups <= 65535, "board.max_groups", self.max_groups, "1..65535")
        _check(0 <= self.max_channels <= 65536, "board.max_channels", self.max_channels, "0..65536")


@dataclass(kw_only=True)
class TracerConfig:
    poll_interval_ms: float = 5.0
    """How often the completion poller checks async work (GPU ops always go through it)."""

    def __post_init__(self) -> None:
        _check(
            0.1 <= self.poll_interval_ms <= 1000,
            "tracer.poll_interval_ms",
            self.poll_interval_ms,
            "0.1..1000",
        )


@dataclass(kw_only=True)
class AgentConfig:
    interval_s: float = 1.0
    """Seconds between two summaries a rank publishes."""
    stack_after_s: float = 5.0
    """Capture the main thread's Python stack once an op is in flight this long."""
    clock_resync_s: float = 60.0
    """Seconds between two clock handshakes with the diagnoser after the first (monotonic
    clocks of different hosts drift apart by up to ~10 ms an hour); 0: never."""

    def __post_init__(self) -> None:
        _check(0.05 <= self.interval_s <= 60, "agent.interval_s", self.interval_s, "0.05..60")
        _check(self.stack_after_s >= 0, "agent.stack_after_s", self.stack_after_s, ">= 0")
        _check(
            self.clock_resync_s == 0 or self.clock_resync_s >= 2 * self.interval_s,
            "agent.clock_resync_s",
            self.clock_resync_s,
            "0 or >= 2 x agent.interval_s",
        )


@dataclass(kw_only=True)
class ControlConfig:
    prefix: str = "ccld/"
    """Key prefix in the store."""
    store: str = "auto"
    """auto: the job's own store when one is reachable, else a dedicated TCPStore;
    dedicated: always host a TCPStore on the diagnoser rank."""
    port: int = 0
    """Port of the dedicated store (0: MASTER_PORT + 1)."""
    chunk_keys: int = 256
    """Keys per multi_get when the diagnoser reads the summaries."""
    connect_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _check(
            self.store in ("auto", "dedicated"),
            "control.store",
            self.store,
            "one of auto, dedicated",
        )
        _check(0 <= self.port <= 65535, "control.port", self.port, "0..65535")
        _check(1 <= self.chunk_keys <= 16384, "control.chunk_keys", self.chunk_keys, "1..16384")
        _check(
            self.connect_timeout_s > 0, "control.connect_timeout_s", self.connect_timeout_s, "> 0"
        )


@dataclass(kw_only=True)
class DiagnoserConfig:
    rank: int = 0
    """Global rank that runs the diagnoser thread."""
    hang_min_s: float = 10.0
    """Floor of the hang threshold."""
    hang_k: float = 5.0
    """The hang threshold is max(hang_min_s, hang_k x p99 duration of that op on that group)."""
    unresponsive_s: float = 10.0
    """A rank whose heartbeat is older than this is unresponsive."""
    window_steps: int = 5
    """Steps per slow-detection window."""
    confirm_windows: int = 2
    """Consecutive windows that must agree before a slow verdict."""
    slow_ratio: float = 1.3
    """A rank is a straggler when its compute time is this many times its cohort's median."""
    mad_k: float = 5.0
    """...and above the cohort median by this many MADs."""

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "diagnoser.rank", self.rank, ">= 0")
        _check(self.hang_min_s > 0, "diagnoser.hang_min_s", self.hang_min_s, "> 0")
        _check(self.hang_k >= 1, "diagnoser.hang_k", self.hang_k, ">= 1")
        _check(self.unresponsive_s > 0, "diagnoser.unresponsive_s", self.unresponsive_s, "> 0")
        _check(self.window_steps >= 1, "diagnoser.window_steps", self.window_steps, ">= 1")
        _check(self.confirm_windows >= 1, "diagnoser.confirm_windows", self.confirm_windows, ">= 1")
        _check(self.slow_ratio > 1, "diagnoser.slow_ratio", self.slow_ratio, "> 1")
        _check(self.mad_k > 0, "diagnoser.mad_k", self.mad_k, "> 0")


@dataclass(kw_only=True)
class WandbConfig:
    enabled: bool = False
    """Diagnosis panels in W&B: into the process's wandb.run if there is one, else a run
    of the sink's own."""
    project: str = "ccld"
    entity: str | None = None
    run_name: str | None = None
    mode: str = "offline"
    """offline needs no account (upload later with `wandb sync`); WANDB_MODE, when set,
    wins."""
    dir: str | None = None
    """Where the sink's own run is written (wandb's `dir`; default: WANDB_DIR or the
    working directory)."""
    log_interval_steps: int = 10
    """Steps between two updates of the per-rank table, bar chart, heatmap and
    per-group bandwidth chart."""
    finish_timeout_s: float = 15.0
    """How long the job's exit waits for the run to be finished; the writer process
    finishes it on its own after that."""

    def __post_init__(self) -> None:
        _check(
            self.mode in ("offline", "online", "disabled"),
            "sinks.wandb.mode",
            self.mode,
            "one of offline, online, disabled",
        )
        _check(
            self.dir is None or bool(self.dir),
            "sinks.wandb.dir",
            self.dir,
            "a directory path or null",
        )
        _check(
            self.log_interval_steps >= 1,
            "sinks.wandb.log_interval_steps",
            self.log_interval_steps,
            ">= 1",
        )
        _check(
            self.finish_timeout_s >= 0,
            "sinks.wandb.finish_timeout_s",
            self.finish_timeout_s,
            ">= 0",
        )


@dataclass(kw_only=True)
class SinksConfig:
    console: bool = True
    """Print one line per verdict on the diagnoser rank."""
    jsonl: str | None = None
    """Append verdicts to this file (a directory means <dir>/verdicts.jsonl)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(kw_only=True)
class CcldConfig:
    enabled: bool = True
    job: str = ""
    """Job name used in board paths and store keys (default: from the launcher's env)."""
    board: BoardConfig = field(default_factory=BoardConfig)
    tracer: TracerConfig = field(default_factory=TracerConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    diagnoser: DiagnoserConfig = field(default_factory=DiagnoserConfig)
    sinks: SinksConfig = field(default_factory=SinksConfig)
    nccl_profiler: bool = False
    """Load the NCCL profiler plugin for channel-level progress of GPU collectives."""


ConfigSource = CcldConfig | Mapping[str, Any] | DictConfig | str | Path | None


def _one_line(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not" in msg:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        allowed = _allowed_keys(parent)
        return f"ccld config: unknown key {key!r}; allowed keys here: {', '.join(allowed)}"
    return f"ccld config: {key or 'value'}: {msg}"


def _allowed_keys(dotted_parent: str) -> list[str]:
    node: Any = CcldConfig
    for part in filter(None, dotted_parent.split(".")):
        fields = {f.name: f for f in dataclasses.fields(node)}
        f = fields.get(part)
        if f is None or not isinstance(f.default_factory, type):
            return sorted(fields)
        node = f.default_factory
    return sorted(f.name for f in dataclasses.fields(node))


def load_config(source: ConfigSource = None, overrides: Iterable[str] = ()) -> CcldConfig:
    """Build a validated config from defaults, a source and ``key=value`` overrides.

    ``source`` may be a :class:`CcldConfig`, a mapping (for example the ``"ccld"`` block of
    a DeepSpeed config), an omegaconf node, or the path of a YAML file.
    """
    schema = OmegaConf.structured(CcldConfig)
    try:
        if isinstance(source, CcldConfig):
            merged = OmegaConf.merge(schema, OmegaConf.structured(source))
        elif isinstance(source, (str, Path)):
            path = Path(source)
            if not path.is_file():
                raise ConfigError(f"ccld config: file {str(path)!r} does not exist")
            merged = OmegaConf.merge(schema, OmegaConf.load(path))
        elif source is None:
            merged = schema
        else:
            merged = OmegaConf.merge(schema, OmegaConf.create(dict(source)))
        items = list(overrides)
        for item in items:
            if "=" not in item:
                raise ConfigError(f"ccld config: override {item!r} must look like KEY=VALUE")
        if items:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(items))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from None
    assert isinstance(cfg, CcldConfig)
    return cfg


def to_yaml(cfg: CcldConfig) -> str:
    """The resolved config as YAML (what ``ccld config`` prints)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
