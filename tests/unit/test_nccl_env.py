"""The NCCL profiler's environment: where NCCL_PROFILER_PLUGIN points and when it is kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ccld_plugin.tracing.nccl_env import LIBRARY_NAME, enable_nccl_profiler_env, nccl_plugin_path


def test_enable_env_keeps_a_value_already_set() -> None:
    env = {"NCCL_PROFILER_PLUGIN": "/opt/other/libnccl-profiler-x.so"}
    assert enable_nccl_profiler_env(env) == "/opt/other/libnccl-profiler-x.so"
    assert env == {"NCCL_PROFILER_PLUGIN": "/opt/other/libnccl-profiler-x.so"}


def test_enable_env_points_at_the_installed_library(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        path = Path(nccl_plugin_path())
    except FileNotFoundError:
        pytest.skip("ccld_plugin is not installed with its native part")
    assert path.is_absolute() and path.is_file() and path.name == LIBRARY_NAME
    assert any(path.parent.glob("_native*.so")), "not beside the extension"
    env: dict[str, str] = {}
    assert enable_nccl_profiler_env(env) == str(path) == env["NCCL_PROFILER_PLUGIN"]
    monkeypatch.delenv("NCCL_PROFILER_PLUGIN", raising=False)
    enable_nccl_profiler_env()
    assert os.environ["NCCL_PROFILER_PLUGIN"] == str(path)
