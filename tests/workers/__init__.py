"""Rank-side code of the multi-rank tests: ``test_<concern>.py`` runs ``workers/<concern>.py``."""
