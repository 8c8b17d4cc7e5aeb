"""Fault injection for tests of the degrade-to-ZeRO-3 paths.

``FCDP_INJECT_FAULT="alloc_host@1,alloc_device"`` makes the named sites raise
:class:`InjectedFault` (on global rank 1 only, or on every rank without ``@rank``);
``alloc_host@1:2`` fails only the 2nd call of that site on rank 1. Sites: ``alloc_host``,
``alloc_device`` (pool chunk allocation), ``alloc_gradbuf_host``, ``alloc_gradbuf_device`` (the node
gradient-accumulation buffer), ``alloc_residual_host``, ``alloc_residual_device`` (grad_compression's
residuals). Unset in production: one environment lookup.

``FCDP_BREAK_INVALIDATION="checkpoint,refresh"`` skips the named invalidation paths (tests of the
tests: the event state machine, ``fcdp_lab/fuzz``, must find each): ``optimizer_write``
(``_unflatten_partitioned_parameters``), ``step_end`` (everything the step may have changed),
``requires_grad`` (the step end's rule for parameters that require grad now, e.g. unfrozen ones),
``checkpoint`` (the flush on checkpoint events), ``refresh`` (``partition(has_been_updated=True)``
leaves a filled slot as it was); ``checkpoint_window`` is not an invalidation but the pre-fix checkpoint epilogue
(issue 33): it drops the accumulation window's partial sums, which the state machine must find too.

``FCDP_BREAK_COMPRESSION="reconstruction@1,own_row,clip"`` breaks the lossy paths (tests of the tests, on global
rank 1 only or on every rank without ``@rank``): ``reconstruction`` (one rank's parameter reconstruction differs
by one ulp in its first element, ``compress/params.py``), ``own_row`` (the gradient codec's own row is quantized,
as before issue 33), ``clip`` (residuals ignore the clip coefficient), ``share`` (a reference checkpoint share
is restored from the wrong peer).

``FCDP_FORCE_REDUCE_SCATTER=1`` (test-only) makes the gradient stages reduce-scatter with
``reduce_scatter_tensor``, NCCL's branch, on gloo too, where they otherwise take all-to-all + a local sum:
the only way that branch runs above one rank without a GPU.
"""
from __future__ import annotations

import os
import time

FAULT_ENV = "FCDP_INJECT_FAULT"
BREAK_ENV = "FCDP_BREAK_INVALIDATION"
FORCE_REDUCE_SCATTER_ENV = "FCDP_FORCE_REDUCE_SCATTER"
INVALIDATION_PATHS = ("optimizer_write", "step_end", "requires_grad", "checkpoint", "refresh",
                      "checkpoint_window")
COMPRESSION_ENV = "FCDP_BREAK_COMPRESSION"
COMPRESSION_PATHS = ("reconstruction", "own_row", "clip", "share")


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


def named_broken(env: str, known: tuple[str, ...], what: str) -> bool:
    """Whether the test-only switch ``env`` (comma-separated names out of ``known``) names ``what``; an unknown
    name is an error (a misspelt broken variant must not pass as the working one). One lookup when unset."""
    value = os.environ.get(env)
    if not value:
        return False
    named = {v.strip() for v in value.split(",") if v.strip()}
    if named - set(known):
        raise ValueError(f"{env}: unknown {sorted(named - set(known))}; known: {known}")
    return what in named


def rank_delay(env: str, rank: int) -> float:
    """Test-only skew: the seconds ``env`` (``"RANK:SECONDS"``) asks ``rank`` to wait, else 0."""
    only, _, seconds = os.environ.get(env, "").partition(":")
    return float(seconds) if only and int(only) == rank else 0.0


def rank_skew(env: str, rank: int) -> None:
    """Sleep the :func:`rank_delay` of ``env`` for ``rank``, and not at all when it is 0.

    [Note: no sleep(0) on a hot path] The skews sit on issue paths (every gradient stage 2, every stage 1, each
    push). ``time.sleep(0)`` is not free: it releases the GIL, and with any other Python thread runnable (a data
    loader's, the cache's) the caller waits up to a switch interval (5 ms) to get it back. Profiled on the bench (4
    ranks on 2 cores), such calls at every stage's issue cost 0.3-1 ms each."""
    delay = rank_delay(env, rank)
    if delay:
        time.sleep(delay)


def invalidation_broken(path: str) -> bool:
    """Whether ``FCDP_BREAK_INVALIDATION`` names ``path`` (test-only; read at every call)."""
    return named_broken(BREAK_ENV, INVALIDATION_PATHS, path)


def compression_broken(path: str) -> bool:
    """Whether ``FCDP_BREAK_COMPRESSION`` names ``path`` for this rank (test-only; one lookup when unset)."""
    value = os.environ.get(COMPRESSION_ENV)
    if not value:
        return False
    rank = int(os.environ.get("RANK", "0"))
    for item in value.split(","):
        name, _, where = item.strip().partition("@")
        if name not in COMPRESSION_PATHS:
            raise ValueError(f"{COMPRESSION_ENV}: unknown path {name!r}; known: {COMPRESSION_PATHS}")
        if name == path and (not where or int(where) == rank):
            return True
    return False


def reduce_scatter_forced() -> bool:
    """Whether ``FCDP_FORCE_REDUCE_SCATTER=1`` (test-only; read when a reducer is built)."""
    return os.environ.get(FORCE_REDUCE_SCATTER_ENV, "") == "1"
