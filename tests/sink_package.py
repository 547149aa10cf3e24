"""A package of the user's that adds a verdict sink without touching ccld: a real
distribution (its module and its ``.dist-info``, as pip installs one) that declares sinks
in the entry point group ``ccld_plugin.sinks``; importlib.metadata finds it on sys.path."""

from __future__ import annotations

from pathlib import Path

SINK_MODULE = '''
import json, os

class FileSink:
    """Appends each verdict record to the file named by CCLD_TEST_SINK_FILE."""

    def __init__(self):
        self.path = os.environ["CCLD_TEST_SINK_FILE"]

    def emit(self, record):
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\\n")

    def close(self):
        with open(self.path, "a") as fh:
            fh.write("closed\\n")


def broken():
    raise RuntimeError("a plugin that cannot start")
'''


def install_sink_package(site: Path) -> None:
    """A distribution ``ccld-test-sink`` in the folder ``site`` as pip installs one: its
    module and its ``.dist-info`` metadata, which declares two sinks in the entry point
    group ``ccld_plugin.sinks`` (one whose factory raises)."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "ccld_test_sink.py").write_text(SINK_MODULE)
    info = site / "ccld_test_sink-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ccld-test-sink\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[ccld_plugin.sinks]\nto_file = ccld_test_sink:FileSink\nbroken = ccld_test_sink:broken\n"
    )
    (info / "RECORD").write_text("")
