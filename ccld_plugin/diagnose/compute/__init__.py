"""Compute: ranks that compute slower than their cohort, step by step (``compute_excess``)."""
