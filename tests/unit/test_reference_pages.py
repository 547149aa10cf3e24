"""The reference cannot drift from the code: every config key and every CLI option is
documented, the generated pages in docs/reference/ are what the code generates, the
version has one source, and the CLI spells the same thing one way."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from importlib.metadata import version

import pytest
from paths import REPO

import ccld_plugin
from ccld_plugin.cli import _parser, main
from ccld_plugin.integrations.megatron.enable import add_ccld_args
from ccld_plugin.reference import config_keys

_spec = importlib.util.spec_from_file_location(
    "reference_pages", REPO / "tools" / "reference_pages.py"
)
assert _spec is not None and _spec.loader is not None
pages = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pages  # its dataclasses look their module up there
_spec.loader.exec_module(pages)


def test_every_config_key_has_a_doc_line() -> None:
    undocumented = [k.key for k in config_keys() if not k.doc]
    assert not undocumented, (
        f"config keys without a doc line (a string under the field in ccld_plugin/config.py): "
        f"{undocumented}"
    )


def test_the_reference_pages_are_what_the_code_generates() -> None:
    stale = pages.stale_pages()
    assert not stale, f"docs/reference/{stale} stale: run python tools/reference_pages.py"


def test_the_facts_table_lists_every_fact_the_diagnosis_emits() -> None:
    facts = pages.evidence_facts()
    text = (REPO / "docs" / "reference" / "evidence-facts.md").read_text()
    assert {"not_entered", "compute_excess", "link_slow", "waits_in", "cycle"} <= set(facts)
    # waits_in is emitted by view.py with data passed by keyword; compute_excess by
    # stragglers.py partly through **measured
    assert facts["waits_in"].data == ["rank", "op", "seq", "role", "members", "peer", "wait_s"]
    assert {"cohort", "ratio", "z", "compute_ms"} <= set(facts["compute_excess"].data)
    assert all(f"| `{name}` |" in text for name in facts)


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    top = _parser()
    found = [("ccld", top)]
    found += [(f"ccld {name}", p) for name, _, p in pages.commands(top)]
    found.append(("megatron add_ccld_args", add_ccld_args(argparse.ArgumentParser())))
    return found


def test_every_option_of_every_command_has_a_help_line() -> None:
    top = _parser()
    assert all(help_text for _, help_text, _ in pages.commands(top)), "a command without help"
    missing = [
        f"{where}: {'/'.join(a.option_strings) or a.dest}"
        for where, parser in _parsers()
        for a in pages.options(parser)
        if not a.help or a.help == argparse.SUPPRESS
    ]
    assert not missing, f"options without a help line: {missing}"


def test_version_has_one_source_the_installed_distribution(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # (tomllib is Python 3.11's; the project runs on 3.10)
    written = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)[1]
    assert ccld_plugin.__version__ == version("ccld-plugin") == written
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"ccld {written}\n"
    # no other file of the package writes the version
    for path in (REPO / "ccld_plugin").rglob("*.py"):
        assert f'"{written}"' not in path.read_text(), path


def test_config_explain_prints_a_keys_documentation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--explain", "diagnoser.hang_min_s"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("diagnoser.hang_min_s  (float, seconds; default 10.0)\n")
    assert "Floor of the hang threshold" in out
    assert main(["config", "--explain", "sinks.wandb"]) == 0
    section = capsys.readouterr().out
    assert section.count("\nsinks.wandb.") + section.startswith("sinks.wandb.") == 8
    assert main(["config", "--explain"]) == 0
    everything = capsys.readouterr().out
    assert all(f"{k.key}  (" in everything for k in config_keys())


def test_config_explain_of_an_unknown_key_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--explain", "diagnoser.hang_min"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no key 'diagnoser.hang_min'; did you mean diagnoser.hang_min_s" in err


@pytest.mark.parametrize(
    "argv, dest, older",
    [
        (["demo"], "out", []),
        (["trace", "x"], "output", ["--output"]),
        (["diagnose", "x"], "jsonl", ["--jsonl"]),
        (["replay", "x"], "jsonl", ["--jsonl"]),
    ],
)
def test_what_a_command_writes_is_o_or_out(argv: list[str], dest: str, older: list[str]) -> None:
    """-o/--out everywhere; an older spelling that scripts may use is the same option."""
    (command,) = [p for name, _, p in pages.commands(_parser()) if name == argv[0]]
    (action,) = [a for a in command._actions if a.dest == dest]
    assert action.option_strings == ["-o", "--out", *older]
    for spelling in action.option_strings:
        args = _parser().parse_args([*argv, spelling, "/tmp/some-file"])
        assert str(getattr(args, dest)) == "/tmp/some-file"
