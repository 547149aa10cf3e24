"""What a demo is asked for (``ccld demo``'s options), checked before anything runs: the
world against what this host can run, the parallel layout against the world, the faults
against the steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ccld_harness.capacity import host_capacity
from ccld_harness.faults.netns import MAX_RANKS
from ccld_harness.faults.spec import FaultSpec, parse_faults

__all__ = [
    "DemoError",
    "DemoOptions",
    "checked_options",
    "default_fault",
    "fit_layout",
    "layout_text",
]


class DemoError(ValueError):
    """A demo that cannot run as asked; the message is one line."""


@dataclass
class DemoOptions:
    framework: str = "megatron"
    world: int = 4
    tp: int = 2  # the command line fits unset sizes to the world: fit_layout
    pp: int = 2
    steps: int = 40
    faults: list[str] = field(default_factory=list)
    out: Path = Path("demo-out")
    overrides: list[str] = field(default_factory=list)
    timeout_s: float = 300.0
    zero_stage: int = 2  # deepspeed only
    netns: bool = False  # ranks in a closed network; implied by a communication fault
    force: bool = False  # write into ``out`` even when it holds files that are not a demo's
    # the diagnoser as a process of its own (``ccld diagnoser``), no rank running one
    diagnoser_process: bool = False
    device: str = "cpu"  # "sim": the torch workload on the simulated device (simdev)


def fit_layout(world: int, tp: int | None, pp: int | None) -> tuple[int, int]:
    """TP and PP sizes for ``world`` ranks, those not given chosen to fit it: TP 2 where the
    world is even, then PP 2 where what is left is (TP2xPP2 at 4 and 8 ranks, TP2 at 2 and
    6, none at 3); sizes given are kept, and checked with the rest of the options."""
    if tp is None:
        tp = 2 if world % (2 * (pp if pp is not None and pp >= 1 else 1)) == 0 else 1
    if pp is None:
        pp = 2 if tp >= 1 and world % (2 * tp) == 0 else 1
    return tp, pp


def default_fault(world: int) -> str:
    """The demo's fault when none is given: a compute hang on rank 2, or the last rank."""
    return f"compute-hang@{min(2, world - 1)}:step=5"


def layout_text(opts: DemoOptions) -> str:
    """The job's parallel layout as the framework runs it (the DeepSpeed example is data
    parallel only: --tp and --pp do not apply to it)."""
    if opts.framework == "deepspeed":
        return f"dp={opts.world} (ZeRO-{opts.zero_stage})"
    device = ", simulated device" if opts.device == "sim" else ""
    return f"tp={opts.tp} pp={opts.pp} dp={opts.world // (opts.tp * opts.pp)}{device}"


def checked_options(opts: DemoOptions) -> list[FaultSpec]:
    """The faults to inject; DemoError (or FaultSpecError) for options that cannot run."""
    for flag, value in (
        ("--world", opts.world),
        ("--tp", opts.tp),
        ("--pp", opts.pp),
        ("--steps", opts.steps),
    ):
        if value < 1:
            raise DemoError(f"ccld demo: {flag} {value} is not allowed; expected a number >= 1")
    capacity = host_capacity(opts.framework)
    if opts.world > capacity.ranks:
        raise DemoError(
            f"ccld demo: --world {opts.world} is more than this host can run: at most "
            f"{capacity.ranks} {opts.framework} ranks ({capacity.why}); lower --world"
        )
    if opts.framework != "deepspeed" and opts.world % (opts.tp * opts.pp):
        raise DemoError(
            f"ccld demo: --world {opts.world} is not a multiple of --tp {opts.tp} x --pp "
            f"{opts.pp}; choose sizes whose product divides the world"
        )
    if opts.device not in ("cpu", "sim"):
        raise DemoError(f"ccld demo: --device {opts.device}; expected cpu or sim")
    if opts.device == "sim" and opts.framework != "torch":
        raise DemoError(
            f"ccld demo: --device sim runs the built-in workload; use --framework torch, not "
            f"{opts.framework} (its training reads results on the host at once, which a "
            "simulated device does not allow)"
        )
    if opts.zero_stage not in (1, 2, 3):
        raise DemoError(f"ccld demo: --zero-stage {opts.zero_stage}; expected 1, 2 or 3")
    if not (math.isfinite(opts.timeout_s) and opts.timeout_s > 0):
        raise DemoError(f"ccld demo: timeout {opts.timeout_s} s; expected a number > 0")
    specs = opts.faults or [default_fault(opts.world)]
    if any(not spec.strip() for spec in specs):
        raise DemoError(
            "ccld demo: --fault '' is empty; give a spec such as compute-hang@2:step=5, or none"
        )
    faults = parse_faults(specs, opts.world)
    if (opts.netns or any(f.is_comm for f in faults)) and opts.world > MAX_RANKS:
        raise DemoError(
            f"ccld demo: --world {opts.world} does not fit the closed network (one /24: at "
            f"most {MAX_RANKS} ranks); lower --world, or drop --netns and communication faults"
        )
    device_fault = next((f for f in faults if f.is_device), None)
    if device_fault is not None and opts.device != "sim":
        raise DemoError(
            f"ccld demo: fault {device_fault} breaks the simulated device; add --device sim "
            "(with --framework torch)"
        )
    late = next((f for f in faults if f.step >= opts.steps), None)
    if late is not None:
        raise DemoError(
            f"ccld demo: fault {late} starts at step {late.step}, after the last step "
            f"({opts.steps - 1}) of --steps {opts.steps}; lower its step or raise --steps"
        )
    return faults
