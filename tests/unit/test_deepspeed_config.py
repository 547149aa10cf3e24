"""The DeepSpeed integration's config: the ``"ccld"`` block read from a dict or a file,
and one-line errors that name the bad key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ccld_plugin import ConfigError
from ccld_plugin.deepspeed import ccld_block, read_config


def test_block_from_dict_and_file(tmp_path: Path) -> None:
    assert ccld_block({"train_batch_size": 8}) is None
    assert read_config({"train_batch_size": 8}, ["enabled=true"]) is None  # no block: off
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"ccld": {"diagnoser": {"hang_min_s": 3}}}))
    assert ccld_block(path) == {"diagnoser": {"hang_min_s": 3}}
    cfg = read_config(str(path), ["agent.interval_s=0.5"])
    assert cfg is not None and cfg.enabled
    assert (cfg.diagnoser.hang_min_s, cfg.agent.interval_s) == (3, 0.5)
    off = read_config({"ccld": {"enabled": False}})
    assert off is not None and not off.enabled


@pytest.mark.parametrize(
    ("block", "overrides", "names"),
    [
        ({"diagnoser": {"window_steps": 0}}, [], "diagnoser.window_steps"),
        ({"agent": {"intervall_s": 1}}, [], "agent.intervall_s"),
        ({}, ["control.store=nearby"], "control.store"),
        ({"enabled": False, "board": {"ring_size": 3}}, [], "board.ring_size"),
        ("on", [], "'ccld' must be an object"),
        ({"diagnoser": {"standby": 1}}, [], "diagnoser.standby=1 is not allowed; expected true"),
        ({"job": 7}, [], "job=7 is not allowed; expected text"),
        ({"board": {"dir": "${oc.env:HOME}"}}, [], "interpolation (${...}) is not supported"),
    ],
)
def test_bad_block_is_one_line_naming_the_key(
    block: object, overrides: list[str], names: str
) -> None:
    with pytest.raises(ConfigError) as err:
        read_config({"ccld": block}, overrides)
    msg = str(err.value)
    assert names in msg and "\n" not in msg


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (None, "missing.json' cannot be read ("),
        ("[1, 2]", "c.json' holds a list; expected a JSON object"),
        ('{"ccld": {oops', "c.json' cannot be read ("),
    ],
)
def test_a_deepspeed_config_file_that_cannot_be_read_is_one_line(
    tmp_path: Path, text: str | None, names: str
) -> None:
    path = tmp_path / ("missing.json" if text is None else "c.json")
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_config(str(path))
    msg = str(err.value)
    assert names in msg and "\n" not in msg and msg.startswith("ccld config: the DeepSpeed")
