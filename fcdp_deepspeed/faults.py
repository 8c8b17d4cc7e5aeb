"""Fault injection for the degrade-to-ZeRO-3 paths.

A failed allocation is what a real job meets when host or accelerator memory runs out: each site below then
degrades the parameters (or the gradient buffer, or the residuals) it was allocating for to plain ZeRO-3, on every
rank alike. These faults are how the tests reach that path without exhausting the machine's memory.

``FCDP_INJECT_FAULT="alloc_host@1,alloc_device"`` makes the named sites raise
:class:`InjectedFault` (on global rank 1 only, or on every rank without ``@rank``);
``alloc_host@1:2`` fails only the 2nd call of that site on rank 1. Sites: ``alloc_host``,
``alloc_device`` (pool chunk allocation), ``alloc_gradbuf_host``, ``alloc_gradbuf_device`` (the node
gradient-accumulation buffer), ``alloc_residual_host``, ``alloc_residual_device`` (grad_compression's
residuals). Unset in production: one environment lookup.
"""
from __future__ import annotations

import os

FAULT_ENV = "FCDP_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """Raised at an injected fault site."""


_calls: dict[str, int] = {}


def _active(site: str, rank: int, call: int) -> bool:
    for item in os.environ.get(FAULT_ENV, "").split(","):
        name, _, where = item.strip().partition("@")
        only_rank, _, only_call = where.partition(":")
        if name == site and (not only_rank or int(only_rank) == rank) and (not only_call or int(only_call) == call):
            return True
    return False


def maybe_fail(site: str) -> None:
    if not os.environ.get(FAULT_ENV):
        return
    _calls[site] = call = _calls.get(site, 0) + 1
    rank = int(os.environ.get("RANK", "0"))
    if _active(site, rank, call):
        raise InjectedFault(f"injected fault at {site} (call {call}) on rank {rank} ({FAULT_ENV})")
