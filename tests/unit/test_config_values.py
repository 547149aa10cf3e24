"""Strict configuration values, from every source (``--set`` overrides, a YAML file, a
mapping such as a DeepSpeed block): booleans are true or false, text stays as written,
whole numbers are decimal and within range, ``${...}`` is never resolved, and an error
line shows at most ~80 characters of a value, on one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from ccld_plugin.board.job_files import JOB_CONFIG
from ccld_plugin.cli import main
from ccld_plugin.config import CcldConfig, ConfigError, load_config, to_yaml
from ccld_plugin.postmortem.diagnose_boards import job_config

LONGEST_LINE = 400  # an error line with every value cut: key, value, path and the rule


def _value(cfg: CcldConfig, key: str) -> Any:
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _nested(key: str, value: Any) -> dict[str, Any]:
    for name in reversed(key.split(".")):
        value = {name: value}
    return value


def _yaml_file(tmp_path: Path, key: str, text: str) -> Path:
    """A config file that sets ``key`` to the scalar ``text``, written as it is."""
    *sections, name = key.split(".")
    lines = [f"{'  ' * depth}{section}:" for depth, section in enumerate(sections)]
    lines.append(f"{'  ' * len(sections)}{name}: {text}")
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _refused(load: Any, message: str) -> str:
    with pytest.raises(ConfigError, match=message) as info:
        load()
    said = str(info.value)
    assert "\n" not in said and len(said) <= LONGEST_LINE, said
    return said


# ------------------------------------------------------------------------------ booleans
BOOL_KEYS = ["diagnoser.standby", "board.cleanup", "enabled", "sinks.wandb.enabled"]
NOT_BOOLS = ["1", "0", "2", "0.0", "yes", "on", "off", "y", "'true'", "null", ""]


@pytest.mark.parametrize("key", BOOL_KEYS)
@pytest.mark.parametrize("text", NOT_BOOLS)
def test_a_bool_key_refuses_all_but_true_and_false_from_an_override(key, text):
    _refused(lambda: load_config(None, [f"{key}={text}"]), rf"{key}=.* expected true or false")


@pytest.mark.parametrize("text", [t for t in NOT_BOOLS if t != "y"])  # plain y is text in YAML
def test_a_bool_key_refuses_all_but_true_and_false_from_a_yaml_file(tmp_path, text):
    path = _yaml_file(tmp_path, "diagnoser.standby", text)
    _refused(lambda: load_config(path), r"line 2: diagnoser.standby=.* expected true or false")


@pytest.mark.parametrize("value", [1, 0, 2, 0.0, "yes", "true", None])
def test_a_bool_key_takes_json_true_and_false_only_from_a_mapping(value):
    block = {"diagnoser": {"standby": value}}
    _refused(lambda: load_config(block), r"diagnoser.standby=.* expected true or false")


@pytest.mark.parametrize(
    ("text", "value", "neighbour"),
    [("true", True, "yes"), ("False", False, "off"), ("TRUE", True, "1")],
)
def test_true_and_false_are_the_booleans_of_every_source(tmp_path, text, value, neighbour):
    assert load_config(None, [f"diagnoser.standby={text}"]).diagnoser.standby is value
    assert load_config(_yaml_file(tmp_path, "diagnoser.standby", text)).diagnoser.standby is value
    assert load_config({"diagnoser": {"standby": value}}).diagnoser.standby is value
    _refused(lambda: load_config(None, [f"diagnoser.standby={neighbour}"]), "true or false")


# ---------------------------------------------------------------------------------- text
TEXT_KEYS = [
    "sinks.jsonl",
    "sinks.wandb.run_name",
    "control.prefix",
    "board.dir",
    "diagnoser.record",
    "sinks.wandb.project",
    "sinks.wandb.entity",
    "sinks.wandb.dir",
]
NUMBER_LIKE = ["007", "1e3", "0x10", "12:30", "1_000", ".inf"]  # YAML 1.1 numbers, all


@pytest.mark.parametrize("key", TEXT_KEYS)
@pytest.mark.parametrize("text", NUMBER_LIKE)
def test_text_is_taken_as_written_from_an_override_and_a_yaml_file(tmp_path, key, text):
    assert _value(load_config(None, [f"{key}={text}"], writing=False), key) == text
    assert _value(load_config(_yaml_file(tmp_path, key, text), writing=False), key) == text


@pytest.mark.parametrize("text", ["007", "1e3", "0x10", "1_000"])
def test_a_job_name_is_taken_as_written(tmp_path, text):
    assert load_config(None, [f"job={text}"]).job == text
    assert load_config(_yaml_file(tmp_path, "job", text)).job == text


def test_quoted_yes_no_is_text_and_plain_yes_no_is_refused(tmp_path):
    assert load_config(None, ["job='true'"]).job == "true"
    assert load_config(None, ['sinks.wandb.run_name="on"']).sinks.wandb.run_name == "on"
    assert load_config(_yaml_file(tmp_path, "job", "'no'")).job == "no"
    _refused(lambda: load_config(None, ["sinks.wandb.run_name=on"]), r"reads as yes/no")
    _refused(lambda: load_config(_yaml_file(tmp_path, "job", "no")), r"job='no' reads as yes/no")


@pytest.mark.parametrize("value", [7, 7.5, 0])
def test_a_number_for_a_text_key_is_refused_from_a_mapping(value):
    _refused(lambda: load_config({"job": value}), rf"job={value} is not allowed; expected text")


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("job='007", r"the quoted value is not valid YAML"),
        ("job='007' x", r"the quoted value is not valid YAML"),
        ("board.dir=/tmp/a\nb", r"board.dir='/tmp/a\\nb' is not allowed; expected text on one"),
        ("board.dir=???", r"\?\?\? marks a missing value in omegaconf"),
    ],
)
def test_text_omegaconf_cannot_hold_as_written_is_refused(item, message):
    _refused(lambda: load_config(None, [item], writing=False), message)


def test_an_accepted_config_reads_back_from_its_yaml(tmp_path):
    """What ``ccld config`` prints and the diagnoser writes beside the boards."""
    cfg = load_config(
        None,
        ["job=007", "sinks.wandb.run_name=12:30", "control.prefix='yes'", "board.dir=0x10"],
        writing=False,
    )
    assert (cfg.job, cfg.sinks.wandb.run_name, cfg.control.prefix) == ("007", "12:30", "yes")
    path = tmp_path / "again.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path, writing=False) == cfg


# ------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("diagnoser.rank=1e20", r"diagnoser.rank='1e20' is not allowed; expected a whole number"),
        ("diagnoser.rank=2.5", r"expected a whole number"),
        ("diagnoser.rank=2147483648", r"expected a rank 0..2147483647, or -1"),
        ("diagnoser.standby_rank=99999999999999999999", r"expected a rank 0..2147483647"),
        pytest.param(
            "diagnoser.rank=" + "9" * 5000,
            r"diagnoser.rank='9+\.\.\.\[cut: 5000 characters\] .* out of range",
            id="rank=9*5000",
        ),
        ("control.port=0x10", r"control.port='0x10' is not allowed; expected a whole number"),
        ("board.ring_size=12:30", r"board.ring_size='12:30' is not allowed"),
        ("diagnoser.window_steps=1_0", r"diagnoser.window_steps='1_0' is not allowed"),
        ("sinks.wandb.log_interval_steps=10000000", r"expected 1..1000000"),
        ("diagnoser.hang_min_s=12:30", r"diagnoser.hang_min_s='12:30' is not allowed; expected a"),
        ("diagnoser.hang_min_s='5'", r"diagnoser.hang_min_s='5' is not allowed; expected a number"),
        pytest.param(
            "diagnoser.hang_min_s=" + "9" * 5000, r"hang_min_s=inf is not allowed", id="s=9*5000"
        ),
    ],
)
def test_a_number_out_of_its_form_or_range_is_one_line_from_an_override(item, message):
    _refused(lambda: load_config(None, [item]), message)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("diagnoser.rank", 1e20, r"diagnoser.rank=1e\+20 is not allowed; expected a whole number"),
        ("diagnoser.rank", 2.0, r"expected a whole number"),
        ("diagnoser.rank", 2**40, r"expected a rank 0..2147483647"),
        ("diagnoser.rank", True, r"expected a whole number"),
        pytest.param(
            "control.port", 10**5000, r"port=<a whole number of about 5001 digits>", id="10**5000"
        ),
        pytest.param(
            "diagnoser.hang_min_s", 10**400, r"hang_min_s=<a whole.* out of range", id="10**400"
        ),
        ("diagnoser.hang_min_s", "5", r"expected a number"),
    ],
)
def test_a_number_out_of_its_type_or_range_is_one_line_from_a_mapping(key, value, message):
    _refused(lambda: load_config(_nested(key, value)), message)


def test_ranks_and_numbers_in_range_are_read(tmp_path):
    cfg = load_config(None, ["diagnoser.rank=2147483647", "diagnoser.standby_rank=-1"])
    assert (cfg.diagnoser.rank, cfg.diagnoser.standby_rank) == (2**31 - 1, -1)
    assert load_config(None, ["control.port=010"]).control.port == 10  # decimal, not octal
    assert load_config(None, ["diagnoser.hang_min_s=1e3"]).diagnoser.hang_min_s == 1000.0
    assert load_config({"diagnoser": {"hang_min_s": 3}}).diagnoser.hang_min_s == 3.0


# ------------------------------------------------------------------------- interpolation
INTERPOLATION = r"interpolation \(\$\{\.\.\.\}\) is not supported; write the value itself"


@pytest.mark.parametrize(
    "item",
    [
        "board.dir=${oc.env:HOME}",
        "sinks.jsonl=${oc.env:HOME}/v.jsonl",
        "diagnoser.hang_min_s=${diagnoser.hang_k}",
        "job='${oc.env:USER}'",
    ],
)
def test_interpolation_is_refused_in_an_override(item):
    _refused(lambda: load_config(None, [item]), INTERPOLATION)


def test_interpolation_is_refused_in_a_file_a_mapping_and_an_omegaconf_node(tmp_path):
    path = _yaml_file(tmp_path, "board.dir", "${oc.env:HOME}")
    _refused(
        lambda: load_config(path), rf"line 2: board.dir='\$\{{oc.env:HOME\}}': {INTERPOLATION}"
    )
    _refused(lambda: load_config({"sinks": {"wandb": {"dir": "${oc.env:HOME}"}}}), INTERPOLATION)
    node = OmegaConf.create({"diagnoser": {"record": "${oc.env:HOME}/r"}})
    _refused(lambda: load_config(node), INTERPOLATION)


def test_a_job_folders_config_is_not_interpolated_by_a_post_mortem(tmp_path):
    (tmp_path / JOB_CONFIG).write_text("diagnoser:\n  record: ${oc.env:HOME}/r\n")
    _refused(lambda: job_config(tmp_path, None, []), INTERPOLATION)


# ---------------------------------------------------------------------- error line length
def test_a_long_value_is_cut_in_its_error_line(tmp_path):
    name = "a" * 100_000
    said = _refused(lambda: load_config(None, [f"job={name}"]), r"\[cut: 100000 characters\]")
    assert said.count("a") < 200
    _refused(lambda: load_config(None, [f"{name}=1"]), r"unknown key 'a+\.\.\.\[cut: 100000")
    _refused(lambda: load_config({"job": name}), r"\[cut: 100000 characters\] is not allowed")
    in_file = _yaml_file(tmp_path, "job", name[:10_000])  # a file holds at most 64 KiB
    _refused(lambda: load_config(in_file), r"job='a+\.\.\.\[cut: 10000 characters\] is not")
    deep = f"/tmp/{name}"
    for key in ("board.dir", "sinks.jsonl", "diagnoser.record"):
        _refused(lambda key=key: load_config(None, [f"{key}={deep}"]), r"cannot be written")


def test_a_value_on_several_lines_stays_on_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('diagnoser:\n  hang_min_s: "a\\nb\\rc"\n')
    _refused(lambda: load_config(path), r"hang_min_s='a\\nb\\rc' is not allowed")


def test_the_cli_says_a_long_value_in_one_cut_line(capsys):
    assert main(["config", "--set", "job=" + "\n" * 50 + "b" * 100_000]) == 2
    out = capsys.readouterr()
    (line,) = out.err.splitlines()
    assert out.out == "" and len(line) <= LONGEST_LINE and "[cut: 100050 characters]" in line
