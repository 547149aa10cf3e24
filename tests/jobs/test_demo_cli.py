"""Fault specs: parsing, and one-line errors for bad specs (also through the CLI)."""

import subprocess
import sys


def test_demo_rejects_a_bad_spec_before_launching(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ccld_plugin.cli",
            "demo",
            "--fault",
            "compute-hang@9",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "ccld: error: fault 'compute-hang@9:step=3': rank 9 is outside the world of 4 ranks"
    )
    assert not (tmp_path / "logs").exists()
