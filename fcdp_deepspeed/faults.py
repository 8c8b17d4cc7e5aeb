"""Fault injection for tests of the degrade-to-ZeRO-3 paths.

``FCDP_INJECT_FAULT="alloc_host@1,alloc_device"`` makes the named sites raise
:class:`InjectedFault` (on global rank 1 only, or on every rank without ``@rank``). Sites:
``alloc_host``, ``alloc_device`` (pool chunk allocation). Unset in production: a dict lookup.
"""
from __future__ import annotations

import os

FAULT_ENV = "FCDP_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """Raised at an injected fault site."""


def _active(site: str, rank: int) -> bool:
    for item in os.environ.get(FAULT_ENV, "").split(","):
        name, _, only_rank = item.strip().partition("@")
        if name == site and (not only_rank or int(only_rank) == rank):
            return True
    return False


def maybe_fail(site: str) -> None:
    if not os.environ.get(FAULT_ENV):
        return
    rank = int(os.environ.get("RANK", "0"))
    if _active(site, rank):
        raise InjectedFault(f"injected fault at {site} on rank {rank} ({FAULT_ENV})")
