"""Topology registry: pure, on synthetic groups laid out like Megatron's."""

import os
import subprocess
import sys

from ccld_plugin.topology import group_id_of


def test_group_id_is_stable_across_processes_and_order_free():
    code = "from ccld_plugin.topology import group_id_of; print(group_id_of([0, 1, 5]))"
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert int(other.stdout) == group_id_of([5, 0, 1])
    assert group_id_of([0, 1]) != group_id_of([0, 2])
    assert 0 < group_id_of([0, 1]) < 2**64
