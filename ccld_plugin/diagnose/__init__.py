"""Diagnosis: pure functions and state over rank summaries; no torch, no native code.

view (one round's picture) -> hang (wait-for graph, mismatch, unresponsive) and slow
(wait / transfer decomposition, stragglers, slow links) -> analyzer (rounds, dedup) ->
records (the Verdict).
"""

from ccld_plugin.diagnose.analyzer import Diagnoser
from ccld_plugin.diagnose.records import Cause, Kind, Verdict
from ccld_plugin.diagnose.view import JobView

__all__ = ["Cause", "Diagnoser", "JobView", "Kind", "Verdict"]
