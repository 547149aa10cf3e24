"""Compute: ranks that compute slower than their cohort, step by step (``compute_excess``),
judged stragglers (``stragglers``) when their peers wait for them (``confirmation``) or
when their host holds them back (``host_wait``)."""
