"""Fault specs: parsing, and one-line errors for bad specs (also through the CLI)."""

import pytest

from ccld_harness.faults import FaultSpecError, parse_fault, parse_faults


def test_specs_parse_with_defaults():
    f = parse_fault("compute-slow@1:factor=2.5,step=7")
    assert (f.kind, f.rank, f.factor, f.step) == ("compute-slow", 1, 2.5, 7)
    assert parse_fault("compute-hang@2").step == 3
    assert parse_fault("comm-slow@0:rate=50mbit").rate == "50mbit"
    assert parse_fault("comm-hang@3:step=4").is_comm
    assert parse_faults(["none"]) == []
    late = parse_fault("comm-hang@2:step=4,after_s=0.5")
    assert (late.after_s, str(late)) == (0.5, "comm-hang@2:step=4,after_s=0.5")
    assert parse_fault(str(late)) == late
    assert [str(f) for f in parse_faults(["mismatch@1:step=2", "compute-hang@0"])] == [
        "mismatch@1:step=2",
        "compute-hang@0:step=3",
    ]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("compute-sloww@1:factor=2", "unknown kind 'compute-sloww'"),
        ("compute-hang", "needs a rank after '@'"),
        ("compute-hang@x", "needs a rank after '@'"),
        ("compute-slow@1", "needs factor=..."),
        ("compute-slow@1:factor=0.5", r"factor must be in \(1, 100\]"),
        ("compute-hang@1:when=3", "unknown parameter 'when'"),
        ("comm-slow@1:rate=fast", "must look like 20mbit"),
        ("compute-hang@1:step", "must be key=value"),
        ("compute-hang@1:step=-1", "step must be >= 0"),
        ("comm-hang@1:after_s=soon", r"after_s must be seconds in \[0, 600\]"),
        ("compute-hang@1:after_s=1", "unknown parameter 'after_s'"),
    ],
)
def test_bad_specs_are_one_line_errors(spec, message):
    with pytest.raises(FaultSpecError, match=message) as info:
        parse_fault(spec)
    assert "\n" not in str(info.value)


def test_rank_outside_the_world_is_rejected():
    with pytest.raises(FaultSpecError, match="outside the world of 4 ranks"):
        parse_faults(["compute-hang@4"], world=4)
