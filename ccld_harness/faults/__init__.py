"""Fault injection for tests, benchmarks and the demo.

``spec`` parses fault specs such as ``compute-hang@2:step=5``; ``inject`` applies compute
faults inside a rank; ``netns`` builds the closed-box network that communication faults
act on.
"""

from ccld_harness.faults.inject import Injector, injector_for
from ccld_harness.faults.spec import FaultSpec, FaultSpecError, parse_fault, parse_faults

__all__ = ["FaultSpec", "FaultSpecError", "Injector", "injector_for", "parse_fault", "parse_faults"]
