"""The steps a summary carries: each for STEP_TICKS ticks after it ends, at most the last
STEPS_KEPT."""

from __future__ import annotations

from ccld_plugin.agent.recent_steps import STEP_TICKS, STEPS_KEPT, RecentSteps
from ccld_plugin.wire.summary import StepStat


def steps(*numbers: int) -> list[StepStat]:
    return [StepStat(k, k * 1000, 900, 800) for k in numbers]


def test_a_slow_step_is_repeated_for_step_ticks_then_dropped() -> None:
    recent = RecentSteps()
    sent = [[st.step for st in recent.tick(steps(1))]]
    sent += [[st.step for st in recent.tick([])] for _ in range(STEP_TICKS)]
    # one step every other tick: each stays STEP_TICKS ticks, a diagnoser reading every
    # STEP_TICKS-th summary sees them all
    assert sent[:STEP_TICKS] == [[1]] * STEP_TICKS and sent[STEP_TICKS] == []
    # A step every other tick, read every STEP_TICKS-th tick: every step is seen.
    seen = set()
    for tick in range(1, 43):
        out = [st.step for st in recent.tick(steps(100 + tick // 2) if tick % 2 else [])]
        assert out == sorted(out) and len(out) <= STEP_TICKS
        if tick % STEP_TICKS == 0:
            seen.update(out)
    assert seen == set(range(100, 121))


def test_fast_steps_keep_only_the_last_steps_kept() -> None:
    recent = RecentSteps()
    out = recent.tick(steps(*range(50)))
    assert [st.step for st in out] == list(range(50 - STEPS_KEPT, 50))
    out = recent.tick(steps(50, 51))
    assert [st.step for st in out] == list(range(52 - STEPS_KEPT, 52))
