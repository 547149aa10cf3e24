"""Where things are in the checkout, for every test tier."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "ccld_plugin" / "csrc"
CONFIGS = REPO / "configs"
EXAMPLES = REPO / "examples"
NATIVE_TESTS = REPO / "tests" / "native"
