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

``link.*`` (the paths' choice, ``machine/link.py``): ``no_agreement`` (each rank decides from its own probe),
``no_vote`` (each data-parallel group keeps its own choice).

``layered.depth_first`` (``fcdp.layered``'s chunks run one at a time through every layer, ``layered/stack.py``),
``layered.boundary_early_drop`` (a host boundary's pinned copy dropped when its copy back is queued) and
``layered.boundary_no_retire`` (never retired: freed as its last reference dies, with no event; ``layered/boundary.py``).

``gather.*`` (the deferred stage 2s, ``runtime/sequencer.py``): ``drain_own`` (a wait issues only its own stage 2, in
each rank's wait order), ``stage2_early`` (stage 2 without waiting for stage 1), ``delay=SECONDS`` (every stage 1
issued that late).

"""
from __future__ import annotations

import time
from typing import Optional

from fcdp_lab.sabotage import replace, variant, wrap


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
@variant("invalidation.optimizer_write")
def _optimizer_write(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.invalidation import Invalidation

    def make(original):
        def params(self, params, reason):
            return 0 if reason == "optimizer_write" else original(self, params, reason)
        return params
    wrap(Invalidation, "params", make)


@variant("invalidation.step_end")
def _step_end(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.invalidation import Invalidation
    wrap(Invalidation, "changed", lambda original: lambda self: None)


@variant("invalidation.requires_grad")
def _requires_grad(value: Optional[str]) -> None:
    """The step end's rule without ``requires_grad``: a parameter unfrozen between steps is served as frozen."""
    from fcdp_deepspeed.runtime.invalidation import Invalidation
    wrap(Invalidation, "stepped",
          lambda original: lambda self, param: param.ds_id in self.optimizer_ids or not self.keep_frozen)


@variant("invalidation.checkpoint")
def _checkpoint(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.invalidation import Invalidation

    def make(original):
        def flush(self, reason):
            return None if reason == "checkpoint" else original(self, reason)
        return flush
    wrap(Invalidation, "flush", make)


@variant("invalidation.refresh")
def _refresh(value: Optional[str]) -> None:
    """A refill of a filled slot (``partition(has_been_updated=True)``) does not happen: the slot keeps the old value."""
    from fcdp_deepspeed.storage.cache import NodeCache

    def make(original):
        def _fill(self, entry, refresh, taken):
            return None if refresh else original(self, entry, refresh, taken)
        return _fill
    wrap(NodeCache, "_fill", make)


@variant("invalidation.checkpoint_window")
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
    wrap(FCDPStage3, "checkpoint_event_epilogue", make)


# -- push -----------------------------------------------------------------------------------------------
@variant("push.read_early")
def _read_early(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.sequencer import StageTwo
    from fcdp_deepspeed.runtime.staged import StreamAhead

    def make(original):
        def wait_stage1(self, entry):
            return None if entry.pushed else original(self, entry)
        return wait_stage1
    wrap(StageTwo, "wait_stage1", make)
    replace(StreamAhead, "stash_ready", staticmethod(lambda staged: None))


@variant("push.skip_invalidation")
def _skip_invalidation(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.runahead import RunAhead

    def make(original):
        def cancel(self, params, unused=False):
            return None if params is not None else original(self, params, unused)
        return cancel
    wrap(RunAhead, "cancel", make)


@variant("push.stale_reference")
def _stale_reference(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime import runahead
    wrap(runahead, "_pop_overlapping_lossy", lambda original: lambda pending, key: [])


@variant("push.delay")
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
    wrap(RunAhead, "push", make)


# -- gather ---------------------------------------------------------------------------------------------
@variant("gather.drain_own")
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
    wrap(StageTwo, "drain", make)


@variant("gather.stage2_early")
def _stage2_early(value: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.sequencer import StageTwo
    wrap(StageTwo, "wait_stage1", lambda original: lambda self, entry: None)


@variant("gather.delay")
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
    wrap(HierarchicalGather, "stage1", make)


# -- link ------------------------------------------------------------------------------------------------------
@variant("link.no_agreement")
def _no_agreement(value: Optional[str]) -> None:
    """Each rank decides from its own times ([Note: one choice per job] in ``machine/link.py``)."""
    from fcdp_deepspeed.machine import link
    replace(link, "agree", lambda times, dp_group: times)


@variant("link.no_vote")
def _no_vote(value: Optional[str]) -> None:
    """Each data-parallel group keeps its own choice, the job's vote skipped ([Note: one choice per job])."""
    from fcdp_deepspeed.machine import link
    replace(link, "vote", lambda local, topo: local if local is not None else link._nothing_to_weigh(topo))


@variant("layered.depth_first")
def _layered_depth_first(value: Optional[str]) -> None:
    """``fcdp.layered`` runs the chunks depth-first: one chunk through every layer before the next (the layers stay
    ZeRO-3 leaf modules), so each layer is gathered once per chunk in forward and in backward."""
    import torch

    from fcdp_deepspeed.layered import split
    from fcdp_deepspeed.layered.stack import LayeredStack

    def make(original_init):
        def init(self, model, config, *args, **kwargs):
            original_init(self, model, config, *args, **kwargs)
            for layer in self.layers:
                layer.forward = layer.forward.__wrapped__
            whole = model.forward

            def forward(*args, **kwargs):
                if not (model.training and torch.is_grad_enabled()):
                    return whole(*args, **kwargs)
                parts = split.split_call(args, kwargs, self.chunks)
                return split.merge([whole(*a, **k) for a, k in parts], [split.first_batch_size(a, k) for a, k in parts])
            model.forward = forward
        return init
    wrap(LayeredStack, "__init__", make)


@variant("layered.boundary_early_drop")
def _layered_boundary_early_drop(value: Optional[str]) -> None:
    """``fcdp.layered``'s host boundaries ([Note: host boundaries]) are dropped as soon as the copy back to the
    accelerator is queued, not once its event is done ([Note: deferred release]): with
    ``DS_PIN_MEMORY_BACKEND=native`` the pinned memory could be reused while that copy still reads it."""
    from fcdp_deepspeed.layered import boundary
    from fcdp_deepspeed.machine import device

    def make(original):
        def unpack(saved):
            out = original(saved)
            host, _, shape = saved
            if shape is not None:
                device.drop_host(host)
            return out
        return unpack
    wrap(boundary, "_unpack", make)


@variant("layered.boundary_no_retire")
def _layered_boundary_no_retire(value: Optional[str]) -> None:
    """``fcdp.layered``'s host boundaries are never retired with their copy back's event ([Note: deferred release]):
    the pinned memory is freed when its last reference dies, which ``DS_PIN_MEMORY_BACKEND=native`` does with no
    event, while the copy back may still read it."""
    from fcdp_deepspeed.layered import boundary
    from fcdp_deepspeed.machine import device

    def unpack(saved):
        host, event, shape = saved
        if shape is None:
            return host
        if event is not None:
            device.wait_event(event)
        return device.to_accel(host).view(shape)
    replace(boundary, "_unpack", unpack)
