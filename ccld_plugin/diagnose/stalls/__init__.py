"""Stalls: what stops the job. Hangs and deadlocks from the wait-for graph and ranks gone
unresponsive (``hang``), members that issued different collectives or left one short
(``mismatch``), ranks that left on an exception of their own (``crash``), and the
diagnoser's own rank cut off (``isolation``)."""
