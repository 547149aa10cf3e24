"""Diagnosis: pure functions and state over rank summaries; no torch, no native code.

One round's picture (``view``) -> ``stalls`` (hangs from the wait-for graph, deadlocks,
mismatches, crashes, the observer's isolation; located by ``links``' TCP and NCCL
evidence) and the slow detector's windows (``slow``: ``compute``'s stragglers, ``links``'
slow links and ports) -> the ``analyzer``'s round (which finding explains which, each told
once) -> ``records`` (the Verdict). Read by all: ``arrivals`` (samples joined per
collective), ``step_table`` (steps as arrays), ``robust`` (medians at scale).
"""

from ccld_plugin.diagnose.analyzer import Analyzer
from ccld_plugin.diagnose.records import Cause, Kind, Verdict
from ccld_plugin.diagnose.view import JobView

__all__ = ["Analyzer", "Cause", "JobView", "Kind", "Verdict"]
