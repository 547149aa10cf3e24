"""Which collectives an agent samples for the arrival order, and when it sends a summary."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ccld_plugin.agent.agent import Agent
from ccld_plugin.agent.board_summary import sampled

OPS_PER_STEP = 16  # a TP group's all-reduces a step: an even number, as in most models


def ops(first: int, last: int) -> np.ndarray:
    out = np.zeros(last - first + 1, dtype=[("seq", "<i8")])
    out["seq"] = np.arange(first, last + 1)
    return out


def test_samples_cover_every_op_of_a_step_not_the_same_few() -> None:
    # A tick of 50 steps, 128 samples kept: one seq in every few. Plain multiples of a
    # power of two would be the same ops of every step (only even ones here), and a rank
    # late only at the others would never be seen arriving last.
    picked = sampled(ops(1, 50 * OPS_PER_STEP), keep=128)
    assert 64 <= len(picked) <= 128
    place_in_step = np.bincount(picked["seq"] % OPS_PER_STEP, minlength=OPS_PER_STEP)
    assert (place_in_step > 0).all(), place_in_step


def test_members_with_ticks_of_other_lengths_pick_seqs_that_join() -> None:
    # Two members of one group cut their ticks at different ops (their agents tick apart):
    # each keeps the seqs of its own density, and the sparser one's are all in the denser
    # one's, so that every seq the sparser sent can be joined.
    dense = set(sampled(ops(101, 300), keep=128)["seq"].tolist())  # 200 ops: 1 in 2
    sparse = set(sampled(ops(101, 600), keep=128)["seq"].tolist())  # 500 ops: 1 in 4
    both = {s for s in sparse if s <= 300}
    assert both and both <= dense


def at(diag_ns: int) -> SimpleNamespace:
    """An agent whose clock reads ``diag_ns`` on the diagnoser's clock."""
    return SimpleNamespace(clock=SimpleNamespace(to_diag=lambda _mono: diag_ns))


def test_one_summary_a_tick() -> None:
    # On time (just after the boundary of tick 10): the next at tick 11's boundary.
    assert abs(Agent._until_next_tick(at(10_010_000_000), 1.0, sent=10) - 0.99) < 1e-9
    # Held up a tick: its summary went at 10.99 s, tick 11's by its clock; the next waits
    # for tick 12 rather than replace it 10 ms later, before a round could read it.
    assert abs(Agent._until_next_tick(at(10_990_000_000), 1.0, sent=11) - 1.01) < 1e-9
    # Nothing sent yet: the next boundary.
    assert abs(Agent._until_next_tick(at(10_990_000_000), 1.0) - 0.01) < 1e-9
