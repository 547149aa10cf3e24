"""Where things are in the checkout, for every test tier."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "ccld_plugin" / "csrc"
CONFIGS = REPO / "configs"
EXAMPLES = REPO / "examples"
NATIVE_TESTS = REPO / "tests" / "native"
# Megatron-LM's training loop at the release of the megatron-core wheel (shared/vendor's
# README): on PYTHONPATH beside the wheel's megatron/core
MEGATRON_LM = REPO.parent / "shared" / "vendor" / "megatron-lm"
