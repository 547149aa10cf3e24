"""The start-up hook installed with the package (``_ccld_autoload``, from
``ccld_autoload.pth``): in every process of the environment, loading nothing until a
watched module is imported; its patches run after the module's own code, a failing patch is
one line and the import goes on, the module's own errors reach the importer unchanged;
``CCLD_AUTOLOAD=0`` turns it off. And Megatron-LM's own parser takes ``--ccld``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import _ccld_autoload
import pytest
from paths import MEGATRON_LM

from ccld_plugin.integrations import autoload
from ccld_plugin.integrations.megatron import add_ccld_args

PROBE = (
    "import json, sys; print(json.dumps({"
    "'finder': any(type(f).__name__ == '_AfterImport' for f in sys.meta_path), "
    "'loaded': sorted(m for m in sys.modules if m.startswith(('ccld', 'torch', '_ccld')))}))"
)


def _fresh_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",  # no checkout on the path: what site-packages holds
    )


def test_the_hook_is_installed_and_loads_nothing_until_a_watched_import():
    on = json.loads(_fresh_python(PROBE, CCLD_AUTOLOAD="1").stdout)
    assert on == {"finder": True, "loaded": ["_ccld_autoload"]}
    off = json.loads(_fresh_python(PROBE, CCLD_AUTOLOAD="0").stdout)
    assert off == {"finder": False, "loaded": ["_ccld_autoload"]}


def test_the_watched_modules_are_the_patched_ones():
    assert set(autoload.PATCHES) == _ccld_autoload.WATCHED


def _module(tmp_path: Path, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(body)
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    return name


def test_a_callback_runs_after_the_modules_code_and_a_failing_one_is_one_line(tmp_path, capsys):
    name = _module(tmp_path, "ccld_watched_ok", "VALUE = 41\n")
    seen: list[int] = []

    def bump(module):
        seen.append(module.VALUE)
        module.VALUE += 1

    def broken(module):
        raise RuntimeError("patch failed\non two lines")

    _ccld_autoload.after_import(name, bump)
    _ccld_autoload.after_import(name, broken)
    import ccld_watched_ok  # type: ignore[import-not-found]

    assert seen == [41] and ccld_watched_ok.VALUE == 42
    err = capsys.readouterr().err
    assert err == "ccld: ccld_watched_ok: RuntimeError: patch failed on two lines\n"
    # already imported: at once, and once
    _ccld_autoload.after_import(name, bump)
    assert seen == [41, 42]
    del sys.modules[name]


def test_the_watched_modules_own_error_reaches_the_importer(tmp_path):
    name = _module(tmp_path, "ccld_watched_bad", "1 / 0\n")
    called: list[object] = []
    _ccld_autoload.after_import(name, called.append)
    with pytest.raises(ZeroDivisionError):
        import ccld_watched_bad  # type: ignore[import-not-found]  # noqa: F401
    assert called == [] and name not in sys.modules


def test_add_ccld_args_twice_is_one_set_of_arguments():
    # Megatron-LM's parser has them from the hook; a script that also passes the provider
    # (the three-line recipe) must not fail with "conflicting option string: --ccld".
    parser = add_ccld_args(add_ccld_args(argparse.ArgumentParser()))
    args = parser.parse_args(["--ccld", "--ccld-set", "diagnoser.hang_min_s=3"])
    assert args.ccld and args.ccld_set == ["diagnoser.hang_min_s=3"]


MEGATRON_LM_PARSE = """
import sys
sys.path.insert(0, sys.argv[1])
from megatron.training.arguments import parse_args
from ccld_plugin.megatron import add_ccld_args
sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--ccld", "--ccld-config", "/dev/null",
            "--ccld-set", "diagnoser.hang_min_s=3", "--ccld-set", "job=x"]
for provider in (None, add_ccld_args):
    args = parse_args(extra_args_provider=provider)
    print(args.ccld, args.ccld_config, args.ccld_set)
"""


@pytest.mark.skipif(not MEGATRON_LM.is_dir(), reason=f"no Megatron-LM at {MEGATRON_LM}")
def test_megatron_lms_own_parser_takes_ccld_and_the_opt_out_removes_it():
    def parse(autoload: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", MEGATRON_LM_PARSE, str(MEGATRON_LM)],
            env={**os.environ, "CCLD_AUTOLOAD": autoload},
            capture_output=True,
            text=True,
            timeout=180,
        )

    on = parse("1")
    line = "True /dev/null ['diagnoser.hang_min_s=3', 'job=x']"
    assert on.stdout.splitlines() == [line, line], on.stderr[-2000:]
    off = parse("0")
    assert off.returncode == 2 and "unrecognized arguments: --ccld" in off.stderr
