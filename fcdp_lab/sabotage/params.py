"""Broken variants of the params path (registered with :func:`fcdp_lab.sabotage.variant`): each puts back one bug the
tests must catch, or a skew that makes a read before completion show.

``invalidation.*`` (the cache's invalidation listeners, ``runtime/invalidation.py``; the event state machine of
``fcdp_lab/fuzz`` must find each): ``optimizer_write`` (the optimizer's writes of partitions), ``step_end``
(everything the step may have changed), ``requires_grad`` (the step end's rule for parameters that require grad now,
e.g. unfrozen ones), ``checkpoint`` (the flush on checkpoint events), ``refresh`` (``partition(has_been_updated=True)``
leaves a filled slot as it was), ``checkpoint_window`` (a checkpoint event drops the accumulation window's partial
sums: not an invalidation, but found by the same machine).

``push.*`` (the run-ahead, ``runtime/runahead.py`` and ``runtime/staged.py``): ``read_early`` (a pushed group's stage 2
does not wait for its stage 1: the queue on gloo, the stash's event on streams), ``skip_invalidation`` (invalidations
leave pending groups), ``stale_reference`` (a pending compressed group survives a fetch that rewrote its references),
``delay=SECONDS`` (the push starts that late: with ``@RANK``, a late peer).

``gather.*`` (the deferred stage 2s, ``runtime/sequencer.py``): ``drain_own`` (a wait issues only its own stage 2, in
each rank's wait order), ``stage2_early`` (stage 2 without waiting for stage 1), ``delay=SECONDS`` (every stage 1
issued that late).

A rank process takes them from ``FCDP_LAB_BREAK`` at start (:func:`fcdp_lab.sabotage.install`: for the whole run). A
worker that compares runs in one process, and the fuzz's rank server between sequences, apply them for a while
instead: :func:`apply` returns what undoes them, :func:`applied` is the same as a context manager.
"""
from __future__ import annotations

import functools
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from fcdp_lab.sabotage import parse, variant

#: This module's variants, by name (the ones :func:`apply` knows).
PATCHES: dict[str, Callable[[Optional[str]], None]] = {}
#: While :func:`apply` runs: ``(owner, attribute, previous value)`` of every attribute set, to restore.
_UNDO: Optional[list] = None
_MISSING = object()


def _variant(name: str) -> Callable:
    def register(patch: Callable[[Optional[str]], None]) -> Callable[[Optional[str]], None]:
        PATCHES[name] = patch
        return variant(name)(patch)
    return register


def _set(owner: Any, attribute: str, value: Any) -> None:
    """``owner.attribute = value``, recorded for :func:`apply`'s undo when one runs."""
    if _UNDO is not None:
        _UNDO.append((owner, attribute, vars(owner).get(attribute, _MISSING)))
    setattr(owner, attribute, value)


def _wrap(owner: Any, attribute: str, make: Callable[[Callable], Callable]) -> None:
    """``owner.attribute`` replaced by ``make(original)`` (``__wrapped__``: the original)."""
    original = getattr(owner, attribute)
    _set(owner, attribute, functools.wraps(original)(make(original)))


def apply(value: str) -> Callable[[], None]:
    """Apply this module's variants named in ``value`` (``FCDP_LAB_BREAK``'s syntax, ``@RANK`` against ``$RANK``)
    now; return what restores every attribute they set."""
    global _UNDO
    rank = int(os.environ.get("RANK", "0"))
    named = parse(value)
    unknown = [name for name, _, _ in named if name not in PATCHES]
    if unknown:
        raise ValueError(f"unknown broken variant {unknown}; known here: {sorted(PATCHES)}")
    undo: list = []
    _UNDO = undo
    try:
        for name, only, arg in named:
            if only is None or only == rank:
                PATCHES[name](arg)
    finally:
        _UNDO = None

    def restore() -> None:
        for owner, attribute, previous in reversed(undo):
            if previous is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, previous)
        undo.clear()
    return restore


@contextmanager
def applied(value: str) -> Iterator[None]:
    """:func:`apply` for the block (``""``: nothing)."""
    restore = apply(value)
    try:
        yield
    finally:
        restore()


def _seconds(value: Optional[str]) -> float:
    """A delay variant's seconds.

    [Note: no sleep(0) on a hot path] A skew wraps an issue path (every stage 1, each push). ``time.sleep(0)`` is
    not free: it releases the GIL, and with any other Python thread runnable (a data loader's, the cache's) the
    caller waits up to a switch interval (5 ms) to get it back; profiled on the bench (4 ranks on 2 cores), such
    calls at every stage's issue cost 0.3-1 ms each. So a skew wraps nothing in the ranks it does not name
    (``@RANK``), nor anywhere for 0 seconds, and the package itself has none."""
    if value is None:
        raise ValueError("a delay variant needs its seconds: NAME=SECONDS")
    return float(value)


# -- invalidation ----------------------------------------------------------------------------------------
@_variant("invalidation.optimizer_write")
def _optimizer_write(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.invalidation import Invalidation

    def make(original):
        def params(self, params, reason):
            return 0 if reason == "optimizer_write" else original(self, params, reason)
        return params
    _wrap(Invalidation, "params", make)


@_variant("invalidation.step_end")
def _step_end(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.invalidation import Invalidation
    _wrap(Invalidation, "changed", lambda original: lambda self: None)


@_variant("invalidation.requires_grad")
def _requires_grad(value: Optional[str]) -> None:
    """The step end's rule without ``requires_grad``: a parameter unfrozen between steps is served as frozen."""
    from fcdp_deepspeed.runtime.invalidation import Invalidation
    _wrap(Invalidation, "stepped",
          lambda original: lambda self, param: param.ds_id in self.optimizer_ids or not self.keep_frozen)


@_variant("invalidation.checkpoint")
def _checkpoint(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.invalidation import Invalidation

    def make(original):
        def flush(self, reason):
            return None if reason == "checkpoint" else original(self, reason)
        return flush
    _wrap(Invalidation, "flush", make)


@_variant("invalidation.refresh")
def _refresh(value: Optional[str]) -> None:
    """A refill of a filled slot (``partition(has_been_updated=True)``) does not happen: the slot keeps the old value."""
    from fcdp_deepspeed.storage.cache import NodeCache

    def make(original):
        def _fill(self, entry, refresh, taken):
            return None if refresh else original(self, entry, refresh, taken)
        return _fill
    _wrap(NodeCache, "_fill", make)


@_variant("invalidation.checkpoint_window")
def _checkpoint_window(value: Optional[str]) -> None:
    """A checkpoint event discards the node buffer's partial window sums (a save, a 16-bit consolidation or a load
    inside an accumulation window), where DeepSpeed keeps its own."""
    from fcdp_deepspeed.engine.stage3 import FCDPStage3

    def make(original):
        def checkpoint_event_epilogue(self):
            if self.fcdp_grads is not None:
                self.fcdp_grads.new_window(discard=True)
            return original(self)
        return checkpoint_event_epilogue
    _wrap(FCDPStage3, "checkpoint_event_epilogue", make)


# -- push -----------------------------------------------------------------------------------------------
@_variant("push.read_early")
def _read_early(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.sequencer import StageTwo
    from fcdp_deepspeed.runtime.staged import StreamAhead

    def make(original):
        def wait_stage1(self, entry):
            return None if entry.pushed else original(self, entry)
        return wait_stage1
    _wrap(StageTwo, "wait_stage1", make)
    _set(StreamAhead, "stash_ready", staticmethod(lambda staged: None))


@_variant("push.skip_invalidation")
def _skip_invalidation(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.runahead import RunAhead

    def make(original):
        def cancel(self, params, unused=False):
            return None if params is not None else original(self, params, unused)
        return cancel
    _wrap(RunAhead, "cancel", make)


@_variant("push.stale_reference")
def _stale_reference(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime import runahead
    _wrap(runahead, "_pop_overlapping_lossy", lambda original: lambda pending, key: [])


@_variant("push.delay")
def _push_delay(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.runahead import RunAhead
    seconds = _seconds(value)
    if not seconds:
        return

    def make(original):
        def push(self):
            time.sleep(seconds)
            return original(self)
        return push
    _wrap(RunAhead, "push", make)


# -- gather ---------------------------------------------------------------------------------------------
@_variant("gather.drain_own")
def _drain_own(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.sequencer import StageTwo

    def make(original):
        def drain(self, upto):
            with self._lock:
                if upto.stage2 is not None:
                    return
                self.pending.remove(upto)
                self._issue(upto)
        return drain
    _wrap(StageTwo, "drain", make)


@_variant("gather.stage2_early")
def _stage2_early(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.sequencer import StageTwo
    _wrap(StageTwo, "wait_stage1", lambda original: lambda self, entry: None)


@_variant("gather.delay")
def _gather_delay(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.gather import HierarchicalGather
    seconds = _seconds(value)
    if not seconds:
        return

    def make(original):
        def stage1(self, *args, **kwargs):
            time.sleep(seconds)
            return original(self, *args, **kwargs)
        return stage1
    _wrap(HierarchicalGather, "stage1", make)
