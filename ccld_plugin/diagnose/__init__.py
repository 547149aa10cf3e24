"""Diagnosis: pure functions and state over rank summaries; no torch, no native code.

view (one round's picture) -> hang (wait-for graph, mismatch, unresponsive; located by
channels' TCP evidence or nccl_waits' NCCL wait states) and slow (arrivals: samples joined
per collective; stragglers, slow groups; slow_links: slow TCP and NCCL links) ->
analyzer (rounds, dedup) -> records (the Verdict). robust: medians at scale.
"""

from ccld_plugin.diagnose.analyzer import Analyzer
from ccld_plugin.diagnose.records import Cause, Kind, Verdict
from ccld_plugin.diagnose.view import JobView

__all__ = ["Analyzer", "Cause", "JobView", "Kind", "Verdict"]
