"""The training each framework's demo runs: the example scripts (shipped in the wheel under
``ccld_harness/examples``, or in a source checkout's ``examples/``) and one rank's command.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EXAMPLE_SCRIPTS", "example_script", "rank_argv"]

EXAMPLE_SCRIPTS = {"megatron": "megatron/pretrain_gpt.py", "deepspeed": "deepspeed/train.py"}


def example_script(framework: str) -> Path:
    """A framework's example training script: shipped in the wheel (``ccld_harness/examples``,
    installed by CMakeLists.txt) or, in a source checkout, ``examples/``."""
    package = Path(__file__).resolve().parent
    rel = EXAMPLE_SCRIPTS[framework]
    for root in (package / "examples", package.parent / "examples"):
        if (root / rel).is_file():
            return root / rel
    raise FileNotFoundError(
        f"the {framework} example ({rel}) is neither in the installed "
        "package nor in a source checkout"
    )


def rank_argv(
    framework: str, tp: int, pp: int, steps: int, zero_stage: int, device: str = "cpu"
) -> list[str]:
    """The command of one rank of ``framework``'s training (its example script, or the
    built-in workload for ``torch``, on ``device``: cpu, or sim, the simulated device).
    Raises FileNotFoundError where the example is missing, ValueError for an unknown
    framework."""
    if framework == "torch":
        return [
            "-m",
            "ccld_harness.workload",
            "--tp",
            str(tp),
            "--pp",
            str(pp),
            "--steps",
            str(steps),
            *(["--device", device] if device != "cpu" else []),
        ]
    if framework == "megatron":
        # A model big enough that compute, not Python overhead, dominates a step.
        return [
            str(example_script(framework)),
            "--tensor-model-parallel-size",
            str(tp),
            "--pipeline-model-parallel-size",
            str(pp),
            "--train-iters",
            str(steps),
            "--hidden-size",
            "128",
            "--seq-length",
            "64",
            "--micro-batch-size",
            "4",
            "--ccld",
        ]
    if framework == "deepspeed":
        return [
            str(example_script(framework)),
            "--zero-stage",
            str(zero_stage),
            "--steps",
            str(steps),
            "--hidden",
            "512",
        ]
    raise ValueError(f"unknown framework {framework!r}; choose megatron, deepspeed or torch")
