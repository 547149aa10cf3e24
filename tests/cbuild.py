"""Compiling the native probe's C sources for the tests: the probe library itself once per
session (the ``probe_library`` fixture of conftest.py), and small C programs against it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from paths import CSRC

WARNINGS = ("-Wall", "-Wextra", "-Werror")


def gcc() -> str:
    path = shutil.which("gcc")
    if path is None:
        pytest.skip("gcc is not installed: the native tests compile the probe's C sources")
    return path


def compile_c(
    out: Path, sources: list[Path], *flags: str, shared: bool = False, libs: tuple[str, ...] = ()
) -> str:
    """Compile ``sources`` into ``out`` (a shared library with ``shared``); the compiler's
    warnings output. A failure fails the test with the compiler's message."""
    cmd = [
        gcc(),
        "-O2",
        "-std=gnu11",
        "-pthread",
        f"-I{CSRC}",
        *flags,
        *(("-shared", "-fPIC") if shared else ()),
        *map(str, sources),
        "-o",
        str(out),
        *libs,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if r.returncode != 0:
        pytest.fail(f"COMPILE FAILED: {' '.join(cmd)}\n{r.stderr}", pytrace=False)
    return r.stderr


def build_probe_library(out_dir: Path) -> tuple[Path, str]:
    """The probe library as CMakeLists.txt builds it (every csrc/*.c), under the name NCCL
    loads it by; with the compiler's output (empty when there is no warning)."""
    lib = out_dir / "libnccl-profiler-ccld.so"
    output = compile_c(lib, sorted(CSRC.glob("*.c")), *WARNINGS, shared=True)
    return lib, output
