"""The steps a summary carries: every step new this tick, and earlier ones for STEP_TICKS
ticks after they end while the summary holds fewer than STEPS_KEPT."""

from __future__ import annotations

from ccld_plugin.agent.recent_steps import MAX_NEW_STEPS, STEP_TICKS, STEPS_KEPT, RecentSteps
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


def test_fast_steps_all_go_and_fewer_earlier_ones_are_repeated() -> None:
    recent = RecentSteps()
    out = recent.tick(steps(*range(50)))  # every step of the tick: none is lost
    assert [st.step for st in out] == list(range(50))
    # the previous tick's steps all go again (its summary may have been overwritten
    # unread), and nothing older beyond STEPS_KEPT
    out = recent.tick(steps(50, 51))
    assert [st.step for st in out] == list(range(52))
    out = recent.tick(steps(52, 53))
    assert [st.step for st in out] == list(range(54 - STEPS_KEPT, 54))
    out = recent.tick(steps(*range(54, 54 + MAX_NEW_STEPS + 9)))
    assert [st.step for st in out] == [52, 53, *range(63, 54 + MAX_NEW_STEPS + 9)]


def test_a_summary_overwritten_unread_loses_no_step() -> None:
    # A fast job's ticks, of which the diagnoser reads every other summary only (one
    # overwritten before its read: a tick and the final one at exit).
    recent = RecentSteps()
    seen: set[int] = set()
    for tick in range(12):
        out = recent.tick(steps(*range(30 * tick, 30 * tick + 30)))
        if tick % 2:
            seen.update(st.step for st in out)
    assert seen == set(range(360))


def test_a_few_earlier_steps_are_all_repeated() -> None:
    # fewer than STEPS_KEPT in all: every one goes again, not only the last few
    recent = RecentSteps()
    recent.tick(steps(*range(1, 11)))
    recent.tick(steps(11))
    assert [st.step for st in recent.tick(steps(12))] == list(range(1, 13))
