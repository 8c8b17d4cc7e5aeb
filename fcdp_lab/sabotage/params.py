"""Broken variants of the params path (registered with :func:`fcdp_lab.sabotage.variant`)."""
from __future__ import annotations

from fcdp_lab.sabotage import variant  # noqa: F401

