"""Config: defaults, overrides, and one-line errors for bad keys and values."""

import pytest
from omegaconf import OmegaConf
from paths import CONFIGS

from ccld_plugin.config import CcldConfig, ConfigError, load_config

DEFAULT_YAML = CONFIGS / "default.yaml"


def test_default_yaml_matches_the_schema():
    assert OmegaConf.to_container(OmegaConf.load(DEFAULT_YAML)) == OmegaConf.to_container(
        OmegaConf.structured(CcldConfig())
    )
    assert load_config(DEFAULT_YAML) == CcldConfig()


def test_dotlist_overrides_and_mappings():
    cfg = load_config(
        {"diagnoser": {"hang_min_s": 3}}, ["agent.interval_s=0.5", "sinks.jsonl=/tmp/v.jsonl"]
    )
    assert cfg.diagnoser.hang_min_s == 3.0
    assert cfg.agent.interval_s == 0.5
    assert cfg.sinks.jsonl == "/tmp/v.jsonl"


@pytest.mark.parametrize(
    "source, overrides, message",
    [
        (None, ["board.ring_sz=8"], r"unknown key 'board.ring_sz'; allowed keys here: .*ring_size"),
        (None, ["bogus=1"], r"unknown key 'bogus'"),
        ({"diagnoser": {"hang_min_s": "soon"}}, [], r"diagnoser.hang_min_s.*'soon'"),
        (
            None,
            ["diagnoser.hang_min_s=-2"],
            r"diagnoser.hang_min_s=-2.0 is not allowed; expected > 0",
        ),
        (None, ["control.store=redis"], r"control.store='redis'.*one of auto, dedicated"),
        (None, ["sinks.wandb.mode=sometimes"], r"sinks.wandb.mode='sometimes'"),
        (None, ["novalue"], r"must look like KEY=VALUE"),
        ("/nonexistent/ccld.yaml", [], r"does not exist"),
        # a yes/no where a path goes: omegaconf alone would write a file named 'True'
        (None, ["diagnoser.record=true"], r"diagnoser.record='true' reads as yes/no.*a path"),
        ({"sinks": {"jsonl": False}}, [], r"sinks.jsonl=False reads as yes/no.*null \(off\)"),
        (None, ["job=yes"], r"job='yes' reads as yes/no; expected text \(quote"),
    ],
)
def test_bad_config_is_one_line_error_naming_key_and_allowed(source, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(source, overrides)
    assert "\n" not in str(info.value)
