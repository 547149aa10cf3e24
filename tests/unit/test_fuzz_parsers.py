"""Fuzzing our own parsers (hypothesis): config dotlists, YAML files and mappings, fault
specs, and the summary and channel codecs the diagnoser reads from the store. No input
gives a traceback or a hang: each is either read, or refused with the parser's own one-line
error (a ValueError; a config's cut to a few hundred characters). And nothing wrong is
presented as right: what is read passes the checks it was validated against, has its key's
type (no coercion: text as written, true/false only, decimal numbers, no ${...}), and reads
back to the same value."""

from __future__ import annotations

import dataclasses
import re
import struct
import typing
from pathlib import Path
from typing import Any

import yaml
from builders import peer_channel, rank_summary
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ccld_harness.faults.spec import FAULT_KINDS, FaultSpec, FaultSpecError, parse_fault
from ccld_plugin.config import CcldConfig, ConfigError, load_config, to_yaml
from ccld_plugin.config_values import read_yaml
from ccld_plugin.wire.codes import OP_NAMES, WAIT_NAMES
from ccld_plugin.wire.peer_channels import (
    MAX_ENTRIES,
    channel_rows,
    decode_channels,
    encode_channels,
)
from ccld_plugin.wire.summary import (
    ArrivalSample,
    GroupProgress,
    InFlightOp,
    StepStat,
    arrival_samples,
    decode_summary,
    encode_summary,
)

FUZZ = settings(
    max_examples=150,
    deadline=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FUZZ_CONFIG = settings(FUZZ, max_examples=50)  # a config load takes ~50 ms (omegaconf)


def _leaves(node: Any = CcldConfig, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(node):
        factory = f.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            out += _leaves(factory, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _leaf_type(key: str) -> Any:
    schema: Any = CcldConfig
    for name in key.split("."):
        schema = typing.get_type_hints(schema)[name]
    return schema


def _value(cfg: CcldConfig, key: str) -> Any:
    value: Any = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return value


KEYS = _leaves()
# names and paths: any text (job names and URLs have a rule; store, mode, on_hang: words)
RULED = ("job", "control.store", "sinks.wandb.mode", "sinks.webhook.url", "actions.on_hang")
FREE_TEXT_KEYS = [k for k in KEYS if _leaf_type(k) in (str, str | None) and k not in RULED]
LONGEST_LINE = 400  # an error line with every value in it cut
WORDS = [
    "true", "no", "null", "''", "[1,2", "{a: 1}", "[]", "${oc.env:HOME}", "${x}", "a\x00",
    "007", "1e3", "0x10", "12:30", "1_000", ".inf", "yes", "on", "'true'", '"on"', "???",
    "a\nb", "2.5", "1e20", "2147483648", "-1", "True", "FALSE", "~", "010", "+3", "0.0",
]  # fmt: skip
SCALARS = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(WORDS),
    st.text(max_size=12),
    st.integers(81, 20_000).map(lambda n: "x" * n),  # cut in an error line
)
OVERRIDE = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS) | st.text(max_size=8), SCALARS),
    st.text(max_size=30),
)


def _typed(cfg: Any, schema: type = CcldConfig) -> None:
    """Each value has its key's type exactly (a bool is no int), and no text holds ${."""
    for name, tp in typing.get_type_hints(schema).items():
        value = getattr(cfg, name)
        if dataclasses.is_dataclass(tp):
            _typed(value, tp)
            continue
        allowed = typing.get_args(tp) or (tp,)
        assert type(value) in allowed, (name, value)
        assert not isinstance(value, str) or "${" not in value, (name, value)


def _revalidated(cfg: CcldConfig) -> Any:
    """The config rebuilt field by field, so that every __post_init__ check runs again on
    the values it holds (an accepted value its own check refuses would raise here)."""
    if not dataclasses.is_dataclass(cfg):
        return cfg
    fields = {f.name: _revalidated(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    return type(cfg)(**fields)


def _config_or_one_line(load: Any) -> CcldConfig | None:
    try:
        cfg = load()
    except ConfigError as exc:
        said = str(exc)
        assert said.startswith("ccld config: ") and "\n" not in said, said
        assert len(said) <= LONGEST_LINE, said[:1000]
        return None
    assert isinstance(cfg, CcldConfig)
    assert _revalidated(cfg) == cfg
    _typed(cfg)
    # what ccld config prints and the diagnoser writes beside the boards reads back the same
    assert load_config(read_yaml(to_yaml(cfg), CcldConfig, "again"), writing=False) == cfg
    return cfg


@FUZZ_CONFIG
@given(st.lists(OVERRIDE, max_size=4))
@example(["[="])  # omegaconf's key parser raised IndexError on it
@example(["diagnoser.rank=" + "9" * 5000])  # int() refuses more than 4300 digits
@example(["diagnoser.hang_min_s=" + "9" * 400])  # an int too large for a float
def test_dotlist_overrides_give_a_config_or_a_one_line_error(items):
    _config_or_one_line(lambda: load_config(None, items))


# Text a YAML file holds as a plain scalar just as an override does: no spaces (YAML trims
# them), no YAML indicator first, no ': ' or ' #' inside.
PLAIN_TEXT = re.compile(r"[A-Za-z0-9_.+][A-Za-z0-9_.:+/-]{0,10}")
PLAIN = st.from_regex(PLAIN_TEXT, fullmatch=True).filter(lambda t: not t.endswith(":"))
YAML_READING = yaml.resolver.Resolver()


def _yaml_reads(text: str) -> str:
    """What YAML reads a plain scalar as: str, int, float, bool, null, timestamp..."""
    return YAML_READING.resolve(yaml.ScalarNode, text, (True, False)).rsplit(":", 1)[-1]


@FUZZ_CONFIG
@given(st.sampled_from(FREE_TEXT_KEYS), PLAIN | st.sampled_from(WORDS))
@example("sinks.wandb.run_name", "12:30")  # YAML 1.1 read 750
def test_text_keys_take_the_text_as_written(key, text):
    cfg = _config_or_one_line(lambda: load_config(None, [f"{key}={text}"], writing=False))
    if PLAIN_TEXT.fullmatch(text) and _yaml_reads(text) not in ("bool", "null"):
        assert cfg is not None and _value(cfg, key) == text
    elif cfg is not None:  # quoted text without its quotes, or null
        assert _value(cfg, key) in (text, text[1:-1], None)


@settings(FUZZ_CONFIG, max_examples=100)
@given(st.sampled_from(KEYS), PLAIN | st.sampled_from([w for w in WORDS if w[:1] not in "[{a"]))
@example("diagnoser.rank", "9" * 5000)  # int() refused it: a traceback from both
def test_an_override_and_a_yaml_file_read_a_value_alike(tmp_path_factory, key, text):
    *sections, name = key.split(".")
    lines = [f"{'  ' * depth}{section}:" for depth, section in enumerate(sections)]
    path = Path(tmp_path_factory.mktemp("yaml")) / "c.yaml"
    path.write_text("\n".join([*lines, f"{'  ' * len(sections)}{name}: {text}"]) + "\n")
    from_file = _config_or_one_line(lambda: load_config(path, writing=False))
    from_override = _config_or_one_line(lambda: load_config(None, [f"{key}={text}"], writing=False))
    assert from_file == from_override


@FUZZ_CONFIG
@given(
    st.sampled_from(["agent.interval_s", "diagnoser.hang_min_s", "diagnoser.unresponsive_s"]),
    st.floats(0.05, 30),  # an interval up to half the clock re-sync period
)
def test_an_accepted_override_is_the_value_given(key, value):
    cfg = load_config(None, [f"{key}={value!r}"])
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == value


MAPPINGS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.dictionaries(
            st.sampled_from([k.split(".")[-1] for k in KEYS] + [k.split(".")[0] for k in KEYS])
            | st.text(max_size=6),
            inner,
            max_size=4,
        )
        | st.lists(inner, max_size=3)
    ),
    max_leaves=12,
)


@FUZZ_CONFIG
@given(st.one_of(MAPPINGS.map(yaml.safe_dump), st.text(max_size=60), st.binary(max_size=60)))
def test_yaml_files_give_a_config_or_a_one_line_error(tmp_path_factory, text):
    path = Path(tmp_path_factory.mktemp("yaml")) / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    _config_or_one_line(lambda: load_config(path))


def _given_leaves(values: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, dict):
            out.update(_given_leaves(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


@FUZZ_CONFIG
@given(MAPPINGS.filter(lambda m: isinstance(m, dict)))
@example({"diagnoser": {"standby": 2}})
@example({"control": {"port": 10**5000}})
def test_a_mapping_gives_its_values_unchanged_or_a_one_line_error(mapping):
    cfg = _config_or_one_line(lambda: load_config(mapping, writing=False))
    if cfg is None:
        return
    for key, written in _given_leaves(mapping).items():
        value = _value(cfg, key)
        assert value == written and (type(value) is type(written) or type(value) is float), key


# ---------------------------------------------------------------------------- fault specs
SPEC_PARTS = st.builds(
    lambda kind, rank, params: f"{kind}@{rank}" + (":" + ",".join(params) if params else ""),
    st.sampled_from([*FAULT_KINDS, "none", ""]) | st.text(max_size=6),
    st.integers(-2, 20).map(str) | st.text(max_size=3),
    st.lists(
        st.builds(
            lambda k, v: f"{k}={v}",
            st.sampled_from(["step", "factor", "rate", "when"]) | st.text(max_size=4),
            st.sampled_from(["3", "2.5", "1", "101", "20mbit", "-1", "1e3", "1_0", "nan", "٣"])
            | st.text(max_size=5),
        ),
        max_size=3,
    ),
)


@FUZZ
@given(st.one_of(SPEC_PARTS, st.text(max_size=40)))
def test_fault_specs_give_a_fault_or_a_one_line_error(text):
    try:
        f = parse_fault(text)
    except FaultSpecError as exc:
        assert "\n" not in str(exc)
        return
    assert f.kind in FAULT_KINDS and f.rank >= 0 and f.step >= 0
    assert parse_fault(str(f)) == f  # the canonical form names the same fault
    if f.kind in ("compute-slow", "device-slow"):
        assert 1 < f.factor <= 100
    if f.kind == "comm-slow":
        assert f.rate.isascii() and f.rate[0].isdigit()


@FUZZ
@given(
    st.sampled_from(sorted(FAULT_KINDS)),
    st.integers(0, 4096),
    st.integers(0, 10**6),
    st.floats(1.001, 100),
)
def test_a_well_formed_spec_is_read_as_written(kind, rank, step, factor):
    slowed = ("compute-slow", "device-slow")
    params = {k: f"factor={factor!r}," for k in slowed} | {"comm-slow": "rate=20mbit,"}
    f = parse_fault(f"{kind}@{rank}:{params.get(kind, '')}step={step}")
    expected = FaultSpec(
        kind,
        rank,
        step,
        factor if kind in slowed else 1.0,
        "20mbit" if kind == "comm-slow" else "",
    )
    assert f == expected


# ---------------------------------------------------------------------------- summaries
U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
TIME = st.integers(0, 2**62)
SUMMARIES = st.builds(
    lambda rank, t, groups, flights, steps, samples, stack, host: rank_summary(
        rank,
        time_ns=t,
        heartbeat_ns=t,
        last_progress_ns=t,
        groups=groups,
        in_flight=flights,
        steps=steps,
        samples=samples,
        stack=stack,
        host=host,
    ),
    st.integers(0, 2**30),  # the builder's pid is 1000 + rank, an int32 too
    st.integers(10**15, 2**62),
    st.lists(
        st.builds(GroupProgress, st.just(0), U64, U64, U32, U32, U64, U32),
        max_size=3,
        unique_by=lambda g: g.slot,
    ).map(lambda gs: [g._replace(slot=i) for i, g in enumerate(gs)]),
    st.lists(
        st.builds(
            lambda op, seq, peer: (
                InFlightOp(0, op, 0, -1, seq, 4, 10**15, 1)
                if peer < 0
                else InFlightOp(0, op, 2, peer, seq, 4, 10**15, 3)
            ),
            st.sampled_from(sorted(OP_NAMES)),
            st.integers(1, 2**63),
            st.integers(-1, 2**31 - 1),
        ),
        max_size=3,
    ),
    st.lists(
        st.builds(
            lambda step, us, share, queued: StepStat(
                step, 10**15, us, us * share // 100, us * (100 - share) * queued // 10_000
            ),
            st.integers(0, 2**31 - 1),
            U32,
            st.integers(0, 100),
            st.integers(0, 100),
        ),
        max_size=3,
    ),
    st.lists(
        st.builds(ArrivalSample, st.just(0), st.integers(1, 2**40), st.just(10**15), U32, U32),
        max_size=3,
    ),
    st.lists(st.text(max_size=30), max_size=4),
    st.text(max_size=20),
)


@FUZZ
@given(SUMMARIES)
def test_a_summary_reads_back_as_written(s):
    back = decode_summary(encode_summary(s))
    assert back.rank == s.rank and back.host == s.host and back.stack == s.stack
    assert back.groups == s.groups and back.in_flight == s.in_flight
    assert [t.step for t in back.steps] == [t.step for t in s.steps]
    assert len(arrival_samples(back)) == len(s.samples)


def _summary_or_error(data: bytes) -> None:
    try:
        s = decode_summary(data)
    except ValueError as exc:
        assert "\n" not in str(exc)
        return
    # what was accepted is exactly what the encoder writes for it, and passes its checks
    assert encode_summary(s) == data
    assert s.rank >= 0 and s.pid > 0 and s.step >= 0 and s.flags < 4
    assert all(op.op in OP_NAMES and op.seq >= 1 for op in s.in_flight)
    assert all(t.compute_us + t.cpu_wait_us <= t.step_us for t in s.steps)


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_are_a_summary_or_refused(data):
    _summary_or_error(b"\x01" + data)


@FUZZ
@given(SUMMARIES, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4))
def test_a_damaged_summary_is_refused_or_still_right(s, flips):
    data = bytearray(encode_summary(s))
    for at, value in flips:
        data[at % len(data)] = value
    _summary_or_error(bytes(data))


@FUZZ
@given(SUMMARIES, st.integers(0, 10**6))
def test_a_truncated_summary_is_refused(s, cut):
    data = encode_summary(s)
    if cut % len(data):
        _summary_or_error(data[: cut % len(data)])


# ---------------------------------------------------------------------------- channels
ENTRIES = st.lists(
    st.builds(
        lambda peer, wait, direction, source, sent, stalled: peer_channel(
            peer,
            wait=wait,
            direction=direction,
            source=source,
            sent=sent,
            stalled_s=stalled / 100,
        ),
        st.integers(0, 2**31 - 1),
        st.sampled_from(WAIT_NAMES),
        st.sampled_from(["send", "recv"]),
        st.sampled_from(["tcp", "nccl"]),
        U32,
        st.integers(0, 0xFFFF),
    ),
    max_size=MAX_ENTRIES,
)


def _channels_agree(data: bytes) -> None:
    """decode_channels and channel_rows accept exactly the same values, alike."""
    rep = decode_channels(3, 10**15, data)
    rows = channel_rows([rank_summary(3, time_ns=10**15, channels=data)])
    assert len(rows.reports) == (rep is not None and len(data) > 0)
    if rep is None:
        assert len(rows.entries) == 0
        return
    assert [e.peer for e in rep.entries] == rows.entries["peer"].tolist()
    assert all(e.wait in WAIT_NAMES and e.peer >= 0 for e in rep.entries)
    again = decode_channels(3, 10**15, encode_channels(rep.entries, rep.interval_s, rep.conns))
    assert again is not None and again.entries == rep.entries


@FUZZ
@given(ENTRIES, st.floats(0.05, 60), st.integers(0, 0xFFFF))
def test_channel_entries_read_back_as_written(entries, interval_s, conns):
    data = encode_channels(entries, interval_s, conns)
    rep = decode_channels(3, 10**15, data)
    assert rep is not None and [e.peer for e in rep.entries] == [e.peer for e in entries]
    assert [(e.wait, e.direction, e.source) for e in rep.entries] == [
        (e.wait, e.direction, e.source) for e in entries
    ]
    _channels_agree(data)


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=120).map(lambda b: b"\x04" + b),
        st.builds(
            lambda entries, flips: bytes(
                _flipped(bytearray(encode_channels(entries, 1.0, 4)), flips)
            ),
            ENTRIES,
            st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
        ),
    )
)
def test_any_channel_value_is_read_alike_or_left_out(data):
    _channels_agree(data)


def _flipped(data: bytearray, flips: list[tuple[int, int]]) -> bytearray:
    for at, value in flips:
        data[at % len(data)] = value
    return data


def test_a_struct_level_truncation_is_a_value_error_not_a_struct_error():
    data = encode_summary(rank_summary(1, stack=["frame"]))
    head = struct.calcsize("<BBiiqqqiHIHHHHHHI")
    for cut in range(head, len(data)):
        _summary_or_error(data[:cut])
