"""The plugin's configuration: one tree of dataclasses, an omegaconf structured config.

Each component receives only its own sub-config. Defaults live here (and are mirrored in
``configs/default.yaml``, which a test keeps in sync). Each source is read strictly as the
schema's types (:mod:`ccld_plugin.config_values`), then merged by omegaconf over the
defaults. Any unknown key or bad value stops at start-up with a one-line
:class:`ConfigError` that names the key, the value (cut when long) and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ccld_plugin.config_file import read_config_file
from ccld_plugin.config_values import (
    ConfigError,
    cut,
    problem,
    read_mapping,
    read_override,
    read_yaml,
    shown,
)

__all__ = [
    "ActionsConfig",
    "AgentConfig",
    "BoardConfig",
    "CcldConfig",
    "ConfigError",
    "ControlConfig",
    "DiagnoserConfig",
    "PrometheusConfig",
    "SinksConfig",
    "TracerConfig",
    "WandbConfig",
    "WebhookConfig",
    "check_paths",
    "check_world",
    "is_job_name",
    "load_config",
    "to_yaml",
]

DAY_S = 86400.0  # the upper bound of every duration: longer ones are typos
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", re.ASCII)
JOB_NAME_RULE = "1-63 of A-Z a-z 0-9 . _ - (starting with a letter or digit, no '..')"
MAX_RANK = 2**31 - 1  # a rank is an int32 on the board and in torch.distributed


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"ccld config: {key}={shown(value)} is not allowed; expected {allowed}")


def _seconds(key: str, value: float, low: float, allowed: str, strict: bool = False) -> None:
    """A duration: finite, at least (or, ``strict``, above) ``low``, at most a day."""
    ok = math.isfinite(value) and (value > low if strict else value >= low) and value <= DAY_S
    _check(ok, key, value, f"{allowed} (seconds, at most {DAY_S:g})")


def _check_job_name(name: str) -> None:
    """A job name is one folder of the board path and part of the store keys."""
    _check(
        name == "" or (JOB_NAME.fullmatch(name) is not None and ".." not in name),
        "job",
        name,
        f"{JOB_NAME_RULE}, or '' for the launcher's run id",
    )


@dataclass(kw_only=True)
class BoardConfig:
    """Each rank's board: the memory-mapped file its tracer writes and everything reads."""

    dir: str = "/dev/shm/ccld-{uid}"
    """Boards are written to ``<dir>/<job>/rank<r>.board`` (``{uid}``: the user's numeric
    id, so that each user has a folder of their own); folders are created with mode 0700,
    board files with mode 0600."""
    ring_size: int = 4096
    """Op records kept per rank (rounded up to a power of two)."""
    max_groups: int = 256
    """Process groups a rank can register."""
    max_channels: int = 512
    """Channel records (per-peer connection progress) per rank."""
    cleanup: bool = True
    """Remove the board files at normal exit (a rank that crashed, or one of whose
    collectives raised, keeps its own); off keeps them all for post-mortems."""

    def __post_init__(self) -> None:
        _check(bool(self.dir), "board.dir", self.dir, "a directory path")
        _check(16 <= self.ring_size <= 1 << 20, "board.ring_size", self.ring_size, "16..1048576")
        _check(1 <= self.max_groups <= 65535, "board.max_groups", self.max_groups, "1..65535")
        _check(0 <= self.max_channels <= 65536, "board.max_channels", self.max_channels, "0..65536")


@dataclass(kw_only=True)
class TracerConfig:
    """The tracer around every collective and point-to-point op of the training thread."""

    poll_interval_ms: float = 5.0
    """How often the completion poller checks async work (GPU ops always go through it)."""
    device_time: bool = True
    """Read the device timeline of device groups (NCCL, or a registered device): when the
    device reached and finished each op, from timing events on its streams, never a host
    sync; the analysis then reads compute, arrivals and hangs from it. False: host clocks
    only, as on a CPU job."""
    work_timing: bool = True
    """With device_time, turn on the process group's own work timing (NCCL's
    ``_enable_collectives_timing``) so that async ops end at their device duration, not at
    the host time they were seen complete."""

    def __post_init__(self) -> None:
        _check(
            math.isfinite(self.poll_interval_ms) and 0.1 <= self.poll_interval_ms <= 1000,
            "tracer.poll_interval_ms",
            self.poll_interval_ms,
            "0.1..1000",
        )


@dataclass(kw_only=True)
class AgentConfig:
    """The agent thread of each rank, which summarizes its board every interval."""

    interval_s: float = 1.0
    """Seconds between two summaries a rank publishes."""
    stack_after_s: float = 5.0
    """Capture the main thread's Python stack once an op is in flight this long."""
    clock_resync_s: float = 60.0
    """Seconds between two clock handshakes with the diagnoser after the first (monotonic
    clocks of different hosts drift apart by up to ~10 ms an hour); 0: never."""
    reach_port: bool = True
    """Hold a TCP port (bound, never listened on) that the diagnoser tries to connect to
    when the rank falls silent: its kernel refuses the handshake while the process is
    wedged, and nothing answers while its link is cut. false: no port; such a silent rank
    stays ambiguous."""

    def __post_init__(self) -> None:
        _check(
            math.isfinite(self.interval_s) and 0.05 <= self.interval_s <= 60,
            "agent.interval_s",
            self.interval_s,
            "0.05..60",
        )
        _seconds("agent.stack_after_s", self.stack_after_s, 0, ">= 0")
        _seconds("agent.clock_resync_s", self.clock_resync_s, 0, ">= 0")
        _check(
            self.clock_resync_s == 0 or self.clock_resync_s >= 2 * self.interval_s,
            "agent.clock_resync_s",
            self.clock_resync_s,
            "0 or >= 2 x agent.interval_s",
        )


@dataclass(kw_only=True)
class ControlConfig:
    """The control plane: the TCPStore through which summaries reach the diagnoser."""

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
    """How long a rank (and ``ccld diagnoser``) waits for the store to answer at start."""
    ranks_per_node: int = 0
    """Ranks per node for node summaries (one store key per node, published by the node's
    first live rank): 0 = the launcher's LOCAL_WORLD_SIZE (1 when unset); set it to split
    one host's ranks into simulated nodes."""

    def __post_init__(self) -> None:
        _check(
            0 <= self.ranks_per_node <= 65535,
            "control.ranks_per_node",
            self.ranks_per_node,
            "0..65535 (0: LOCAL_WORLD_SIZE)",
        )
        _check(
            self.store in ("auto", "dedicated"),
            "control.store",
            self.store,
            "one of auto, dedicated",
        )
        _check(0 <= self.port <= 65535, "control.port", self.port, "0..65535")
        _check(1 <= self.chunk_keys <= 16384, "control.chunk_keys", self.chunk_keys, "1..16384")
        _seconds("control.connect_timeout_s", self.connect_timeout_s, 0, "> 0", strict=True)


@dataclass(kw_only=True)
class DiagnoserConfig:
    """Where the diagnoser runs and the thresholds of its verdicts."""

    rank: int = 0
    """Global rank that runs the diagnoser thread; -1: none, the diagnoser runs as a process
    of its own (``ccld diagnoser``), for large jobs."""
    standby: bool = True
    """Run a standby diagnoser that takes diagnosis over when the diagnoser rank dies."""
    standby_rank: int = -1
    """Global rank of the standby; -1: the same local rank on the next node
    (LOCAL_WORLD_SIZE ranks per node), or the next rank in a one-node job (rank 0 for a
    diagnoser of its own)."""
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
    slow_ratio: float = 1.2
    """A straggler's compute time, step by step, is at least this many times its cohort's
    median (the median of its per-step ratios over the windows judged), and ``excess_z``
    standard errors above 1."""
    excess_z: float = 3.0
    """Standard errors by which a straggler's median per-step ratio to its cohort stands
    above 1 (robust: from the MAD of the per-step ratios), so that a host's noise does not
    make one."""
    record: str | None = None
    """A file to record every round's input in (each rank's summary as received), for
    ``ccld replay``: the same diagnosis again, later, with another config or version."""

    def __post_init__(self) -> None:
        _check(
            -1 <= self.rank <= MAX_RANK,
            "diagnoser.rank",
            self.rank,
            f"a rank 0..{MAX_RANK}, or -1 (ccld diagnoser)",
        )
        _check(
            -1 <= self.standby_rank <= MAX_RANK,
            "diagnoser.standby_rank",
            self.standby_rank,
            f"a rank 0..{MAX_RANK}, or -1 (the next node's)",
        )
        _seconds("diagnoser.hang_min_s", self.hang_min_s, 0, "> 0", strict=True)
        _check(
            math.isfinite(self.hang_k) and 1 <= self.hang_k <= 1000,
            "diagnoser.hang_k",
            self.hang_k,
            "1..1000",
        )
        _seconds("diagnoser.unresponsive_s", self.unresponsive_s, 0, "> 0", strict=True)
        _check(
            1 <= self.window_steps <= 100_000,
            "diagnoser.window_steps",
            self.window_steps,
            "1..100000",
        )
        _check(
            1 <= self.confirm_windows <= 1000,
            "diagnoser.confirm_windows",
            self.confirm_windows,
            "1..1000",
        )
        _check(
            math.isfinite(self.slow_ratio) and 1 < self.slow_ratio <= 1000,
            "diagnoser.slow_ratio",
            self.slow_ratio,
            "> 1 and <= 1000",
        )
        _check(
            math.isfinite(self.excess_z) and 0 < self.excess_z <= 1000,
            "diagnoser.excess_z",
            self.excess_z,
            "> 0 and <= 1000",
        )


@dataclass(kw_only=True)
class WandbConfig:
    """The W&B sink: diagnosis panels, a verdict table and an alert per verdict."""

    enabled: bool = False
    """Diagnosis panels in W&B: into the process's wandb.run if there is one, else a run
    of the sink's own."""
    project: str = "ccld"
    """W&B project of the sink's own run."""
    entity: str | None = None
    """W&B entity (user or team) of the sink's own run; null: wandb's default."""
    run_name: str | None = None
    """Name of the sink's own run; null: wandb picks one."""
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
            1 <= self.log_interval_steps <= 1_000_000,
            "sinks.wandb.log_interval_steps",
            self.log_interval_steps,
            "1..1000000",
        )
        _seconds("sinks.wandb.finish_timeout_s", self.finish_timeout_s, 0, ">= 0")


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a bracket left open, a port that is no number
        return False


@dataclass(kw_only=True)
class WebhookConfig:
    url: str | None = None
    """POST each verdict record as JSON to this http(s) URL; null: off."""
    timeout_s: float = 5.0
    """How long one POST may take."""
    retries: int = 3
    """Tries after a failed POST (1 s, 2 s, 4 s ... apart), then the verdict is dropped."""

    def __post_init__(self) -> None:
        _check(
            self.url is None or _is_http_url(self.url),
            "sinks.webhook.url",
            self.url,
            "an http:// or https:// URL with a host, or null",
        )
        _seconds("sinks.webhook.timeout_s", self.timeout_s, 0, "> 0", strict=True)
        _check(0 <= self.retries <= 10, "sinks.webhook.retries", self.retries, "0..10")


@dataclass(kw_only=True)
class PrometheusConfig:
    port: int = 0
    """Serve /metrics from the diagnoser on this port; 0: off."""
    address: str = "0.0.0.0"
    """The address to listen on (0.0.0.0: every interface)."""
    top_k: int = 16
    """Series per family of per-rank and per-link metrics: the slowest this many."""

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "sinks.prometheus.port", self.port, "0..65535 (0: off)")
        _check(bool(self.address), "sinks.prometheus.address", self.address, "an address")
        _check(1 <= self.top_k <= 1024, "sinks.prometheus.top_k", self.top_k, "1..1024")


@dataclass(kw_only=True)
class SinksConfig:
    """Where verdicts go: the diagnoser's console, a JSONL file, W&B."""

    console: bool = True
    """Print one line per verdict on the diagnoser rank."""
    jsonl: str | None = None
    """Append verdicts to this file (a directory, or a path without a suffix, means
    <dir>/verdicts.jsonl); a new file gets mode 0600, missing folders 0700."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    webhook: WebhookConfig = field(default_factory=WebhookConfig)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    plugins: bool = True
    """Feed the sinks that installed packages declare (entry point group
    ``ccld_plugin.sinks``)."""

    def __post_init__(self) -> None:
        _check(
            self.jsonl is None or bool(self.jsonl),
            "sinks.jsonl",
            self.jsonl,
            "a file path or null",
        )

    def jsonl_file(self) -> Path | None:
        """The file the JSONL sink appends to, or None when it is off."""
        if not self.jsonl:
            return None
        path = Path(self.jsonl)
        # os.path.isdir: False, not an OSError, for a name too long to be a folder
        return path / "verdicts.jsonl" if os.path.isdir(path) or not path.suffix else path


@dataclass(kw_only=True)
class ActionsConfig:
    on_hang: str = "none"
    """abort: end every rank of the job (exit code 75) once a stall verdict
    (hang, deadlock, mismatch, unresponsive) stands abort_after_s, so that the launcher's
    restart policy takes over; none: only report."""
    abort_after_s: float = 0.0
    """Seconds a stall verdict must stand (no resumed verdict ends it) before it is acted
    on."""
    exclude_file: str | None = None
    """Append the hosts of a stall's culprits to this file when it is acted on, one a
    line, as ``srun --exclude`` and ``sbatch --exclude`` read a file; null: none."""

    def __post_init__(self) -> None:
        _check(self.on_hang in ("none", "abort"), "actions.on_hang", self.on_hang, "none or abort")
        _seconds("actions.abort_after_s", self.abort_after_s, 0, ">= 0")
        _check(
            self.exclude_file is None or bool(self.exclude_file),
            "actions.exclude_file",
            self.exclude_file,
            "a file path or null",
        )


@dataclass(kw_only=True)
class CcldConfig:
    """The plugin's configuration: the keys of ``configs/default.yaml``."""

    enabled: bool = True
    """false: nothing is wrapped, nothing runs and no path is checked."""
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
    actions: ActionsConfig = field(default_factory=ActionsConfig)

    def __post_init__(self) -> None:
        _check_job_name(self.job)

    def board_root(self) -> Path:
        """``board.dir`` with ``{uid}`` filled in: the folder of the job folders."""
        return Path(self.board.dir.replace("{uid}", str(os.getuid())))


ConfigSource = CcldConfig | Mapping[str, Any] | DictConfig | str | Path | None


def load_config(
    source: ConfigSource = None, overrides: Iterable[str] = (), *, writing: bool = True
) -> CcldConfig:
    """Build a validated config from defaults, a source and ``key=value`` overrides.

    ``source`` may be a :class:`CcldConfig`, a mapping (for example the ``"ccld"`` block of
    a DeepSpeed config), an omegaconf node, or the path of a YAML file. When ``writing``
    (a job about to start), the paths the plugin will write are checked too
    (:func:`check_paths`); a post-mortem reads a finished job's config for its thresholds
    only, possibly on another machine where those paths do not exist.
    """
    layers = [_source_values(source)]
    layers += [read_override(item, CcldConfig) for item in list(overrides)]
    try:
        # every value is of its key's type already: omegaconf merges, it converts nothing
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CcldConfig), *layers))
    except OmegaConfBaseException as exc:  # none known; contained as one line all the same
        raise ConfigError(f"ccld config: {problem(exc)}") from None
    assert isinstance(cfg, CcldConfig)
    if writing:
        check_paths(cfg)
    return cfg


def _source_values(source: ConfigSource) -> dict[str, Any]:
    if isinstance(source, CcldConfig):
        return read_mapping(dataclasses.asdict(source), CcldConfig)
    if isinstance(source, (str, Path)):
        where = f"file {shown(str(source))}"
        return read_yaml(read_config_file(Path(source), where), CcldConfig, where)
    if source is None:
        return {}
    if isinstance(source, DictConfig):  # its text as given: ${...} left for read_mapping
        values = OmegaConf.to_container(source, resolve=False)
        return read_mapping(cast(Mapping[str, Any], values), CcldConfig)
    if isinstance(source, Mapping):
        return read_mapping(source, CcldConfig)
    raise ConfigError(
        f"ccld config: a config of type {type(source).__name__} is not allowed; expected a "
        "CcldConfig, a mapping, an omegaconf DictConfig or the path of a YAML file"
    )


# ---------------------------------------------------------------- paths the plugin writes
def check_paths(cfg: CcldConfig) -> None:
    """Refuse, at start, a path the plugin would fail to write later: the board folder, the
    JSONL file, the recording, the W&B folder, the exclude file. Nothing is created (a
    probe file has no name)."""
    if not cfg.enabled:
        return
    _check_writable("board.dir", cfg.board.dir, cfg.board_root(), directory=True)
    jsonl = cfg.sinks.jsonl_file()
    if jsonl is not None:
        _check_writable("sinks.jsonl", cfg.sinks.jsonl, jsonl, directory=False)
    if cfg.diagnoser.record:
        record = cfg.diagnoser.record
        _check_writable("diagnoser.record", record, Path(record), directory=False)
    wandb = cfg.sinks.wandb
    if wandb.enabled and wandb.dir:
        _check_writable("sinks.wandb.dir", wandb.dir, Path(wandb.dir), directory=True)
    exclude = cfg.actions.exclude_file
    if exclude:
        _check_writable("actions.exclude_file", exclude, Path(exclude), directory=False)


def _check_writable(key: str, value: Any, path: Path, directory: bool) -> None:
    why = _unwritable(path, directory)
    if why is not None:
        raise ConfigError(
            f"ccld config: {key}={shown(value)} cannot be written ({why}); expected a path in a "
            "folder this user can write"
        )


def _unwritable(path: Path, directory: bool) -> str | None:
    """Why nothing could be written at ``path`` (None: it can). The nearest existing
    folder must take a new file: the one the plugin creates, or its missing folders."""
    try:
        existing = path
        while not existing.exists():
            existing = existing.parent
        if existing == path and not directory:
            if not path.is_file():
                return f"{cut(str(path))} is not a regular file"
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC))
            return None
        if not existing.is_dir():
            return f"{cut(str(existing))} is not a folder"
    except OSError as exc:
        return f"{cut(str(exc.filename or path))}: {exc.strerror or problem(exc)}"
    except ValueError as exc:  # a NUL byte
        return problem(exc)
    try:
        with tempfile.TemporaryFile(dir=existing):
            return None
    except OSError as exc:
        return f"no file can be created in {cut(str(existing))}: {exc.strerror or problem(exc)}"


def to_yaml(cfg: CcldConfig) -> str:
    """The resolved config as YAML (what ``ccld config`` prints)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def is_job_name(name: str) -> bool:
    """Whether ``name`` passes the config's job-name rule (JOB_NAME_RULE), for a command
    that takes a job name outside the config (``ccld diagnoser --job``)."""
    try:
        _check_job_name(name)
    except ConfigError:
        return False
    return True


# ---------------------------------------------------------------- ranks of the job
def check_world(cfg: CcldConfig, world: int, how: str = "") -> None:
    """Refuse a rank the config names that a job of ``world`` ranks does not have: known
    once the job's size is, at launch (``how``: where the size comes from) or at start."""
    size = f"{world} rank{'' if world == 1 else 's'}" + (f" ({how})" if how else "")
    d = cfg.diagnoser
    if d.rank >= world:
        raise ConfigError(
            f"ccld config: diagnoser.rank={d.rank} is not a rank of this job of {size}; "
            f"expected 0..{world - 1}, or -1 for a diagnoser process of its own (ccld diagnoser)"
        )
    if d.standby and d.standby_rank >= world:
        raise ConfigError(
            f"ccld config: diagnoser.standby_rank={d.standby_rank} is not a rank of this job "
            f"of {size}; expected 0..{world - 1}, or -1 for the one it picks"
        )
