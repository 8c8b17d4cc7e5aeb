"""Run-ahead: stage 1 of the next window's misses, issued ahead of the fetches that need them: from the window's first
two-stage gather (``fcdp.param_runahead_bytes``, the default) or already at the optimizer step's end (the push,
``fcdp.param_push_bytes``, opt-in).

[Note: from the window's first fetch] The push (below) starts the slow hop at the step's end, so a group that an
invalidation between steps cancels (a checkpoint load, a ``GatheredParameters`` edit) or that the next window does
not fetch crossed the nodes for nothing. The default run-ahead plans at the step's end but issues nothing until the
window's first two-stage gather: if that gather is the plan's first group, it issues the plan's budget prefix (the
fetch takes its own group from it) and rolls on as the push does ([Note: a rolling push]); if not, the window does
not follow the plan and nothing is issued ahead in it. So every event between steps has been applied before a byte
crosses, the bytes per step are the window's own (exactly the bound while the window fetches as the last one did),
and the head start lost against the push is the time from the step's end to the first fetch (data loading: about
nothing in the bench). A batched refill (LoRA's adapters, ``refill.py``) is the window's first gather and the whole
plan: issued where it was anyway. Agreed: the first two-stage gather after a step is the same call on every rank.

[Note: one group runs nothing ahead] From the window's first fetch, a plan of one group (LoRA's batched refill of
every adapter, ``refill.py``) has nothing to run ahead of: that group is the first fetch's own. Taken through the
run-ahead it was slower than the fetch's own gather (LoRA at 10 Mbit/s, emulated 2 x 2, five interleaved repeats:
0.192 vs 0.176 s per step; cause not isolated), so such a plan is dropped and the fetch gathers as without the
run-ahead. The push (from the step's end) keeps a one-group plan: it does run ahead of the window.

[Note: the slow hop runs ahead]
After a step every trainable parameter is a miss at its next fetch, and stage 1 of the two-stage gather (the
inter-node all-gather among node peers, ``gather.py``) used to run inside that fetch, before the compute it
could have overlapped. The partitions it sends (``ds_tensor``) are final once the step wrote them, so each rank
issues stage 1 of every group the next window will gather in two stages, in order, asynchronously, right at
the end of the step (``_post_step``, after the step's invalidation): the transfers cross while the host
finishes the step, loads data and runs the forward's earlier modules. A fetch of exactly a pending group's
parameters takes it (:meth:`RunAhead.take`): its stage 2 waits for that work in the gather's queue
(``sequencer.py``; ``push_wait`` in the timeline); anything else takes the normal path.

[Note: what is pushed] The groups the last window gathered in two stages (each one module's parameters of one
dtype: ``gather.units``, also for DeepSpeed's coalesced prefetch, ``gather.PerModuleHandle``), in their order, each
split into exact and compressed parts as the references are at the plan (``gather.split``: a unit gathered exactly
at its first gather is compressed from the next; after a refresh the other way round); when the batched refill
(``refill.py``) will refill the stale parameters at the next miss, that batch is pushed as one group instead (and the trace's groups without its parameters): the batch is what the next window
gathers, and a push in any other grouping crossed the nodes for nothing, the refill's own stage 1 crossing again
(``param_push_unused`` counts what no fetch took; ``tests/test_gather.py`` requires none under LoRA).

Correctness:
- *never read before complete*: stage 2 reads the bundle only after ``Work.wait`` of its stage 1 (the queue)
  (``StageTwo.wait_stage1``; a test that skips that wait must see wrong values);
- *never read stale*: every invalidation event (``runtime/invalidation.py``'s three, and
  ``partition(has_been_updated=True)``) cancels the pending groups of the parameters it names before anything
  can read them (:meth:`RunAhead.cancel`; a test that ignores them must see a stale value);
- *agreement*: the trace is the sequence of two-stage gathers, identical on every rank (issued collectively,
  in ``ds_id`` order), the batch is decided from the cache's agreed state; pushes happen at the same logical
  point (the step's end) and a pending group is used only by a fetch of exactly its parameters, which every
  rank makes at the same point. The hit/miss decision is unchanged (a pushed parameter is still a miss; its
  fill on release is the normal one). Cancelling waits for the work (every rank issued it) and issues nothing.

Memory: a pending group holds its full gathered size (W x P elements), at most ``fcdp.param_push_bytes``
together (the host budget of the run-ahead; 0 turns it off), refilled as fetches take groups ([Note: a rolling
push]); a compressed one also holds its messages, the references it read (copies on an accelerator) and an fp32
copy of its own partition (not counted: together at most about (N + 3)/W of that size). That is on gloo. On an
accelerator with streams (NCCL) the run-ahead is opt-in (``fcdp.param_runahead_streams``): a pending group is its
node bundle in pinned host memory (N x P elements, counted against the same budget), exact groups only ([Note: the
run-ahead on streams] in ``staged.py``).

[Note: compressed groups run ahead] With ``fcdp.param_compression`` a group whose stage 1 is compressed runs ahead
too: it is encoded when it is issued (against the references of that moment) and decoded, writing the new references,
when its fetch's queue waits for it ([Note: the compressed stage 1 in flight] in ``runtime/compressed_gather.py``). Between the
two nothing else may write those references: a fetch that gathers one of its parameters in another grouping (its own
stage 1 rewrites the reference) drops it first, so does a fetch whose split (exact or compressed, decided from the
references as they are then) differs from the plan's, and every invalidation drops it as for an exact group.
Dropping completes the collective and decodes nothing: the references stay as they were on every peer. A planned
group is issued only if it still splits as planned; the periodic refresh drops the references before the push
plans (``FCDPRuntime.on_step_end``), so a refresh step's plan is exact. A test that keeps a pending compressed group
across a fetch that rewrote its references (:func:`_pop_overlapping_lossy` skipped) must see a wrong reconstruction.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Optional, Sequence

import torch

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from fcdp_deepspeed.machine import device
from fcdp_deepspeed.reporting.stats import EventCounters
from fcdp_deepspeed.runtime.staged import StreamAhead
from fcdp_deepspeed.storage import freshness

#: The most two-stage gathers one window's trace keeps (``RunAhead.trace``): bounded whatever runs between pushes.
MAX_TRACE = 4096


class Start(Enum):
    """Where a plan made at the step's end is issued."""

    #: At the window's first two-stage gather ([Note: from the window's first fetch]): the default run-ahead.
    FIRST_FETCH = "first_fetch"
    #: At the step's end: the push (``param_push_bytes``, opt-in).
    STEP_END = "step_end"


@dataclass
class RunAheadCounters(EventCounters):
    pushed: int = 0
    """Groups whose stage 1 was issued at a step's end (the push) or at the window's first fetch."""
    used: int = 0
    """Pushed groups a fetch used."""
    cancelled: int = 0
    """Pushed groups an invalidation dropped (their values changed: the fetch crosses again, exactly)."""
    unused: int = 0
    """Pushed groups no fetch took before the next push (a changed fetch pattern: bytes crossed for nothing)."""
    pushed_bytes: int = 0
    rolled: int = 0
    """Groups issued later, by a fetch that took a pushed group ([Note: a rolling push])."""
    stale: int = 0
    """Pending groups found older than a partition they hold when a fetch took them: dropped, gathered anew
    ([Note: freshness by construction] in ``storage/freshness.py``; zero while every invalidation cancels)."""


def _key(params: Sequence[torch.nn.Parameter]) -> tuple[int, ...]:
    return tuple(p.ds_id for p in params)


def _pop_overlapping_lossy(pending: dict, key: tuple[int, ...]) -> list["Pending"]:
    """Remove from ``pending`` and return its compressed groups sharing a parameter with ``key`` (under the lock)."""
    ids = set(key)
    out = [v for k, v in pending.items() if v.lossy and ids.intersection(k)]
    for v in out:
        del pending[v.key]
    return out


@dataclass(eq=False)
class Pending:
    """One group's stage 1 in flight: its buffers (``HierarchicalGather.buffers``) and the work."""

    key: tuple[int, ...]
    flat: torch.Tensor
    bundle: torch.Tensor
    part: int
    #: What completes stage 1: its work, or under ``fcdp.param_compression`` a ``StageOne`` (``runtime/compressed_gather.py``).
    work: Any
    nbytes: int = 0
    #: A compressed stage 1 ([Note: compressed groups run ahead]).
    lossy: bool = False
    #: The partitions' stamps when stage 1 was issued (``freshness.py``): taken only while they are the stamps now.
    taken: tuple[int, ...] = ()
    params: tuple = ()

    def drop(self) -> None:
        """Complete the collective (every peer issued it) without using it: a compressed one decodes nothing and
        writes no reference."""
        discard = getattr(self.work, "discard", None)  # a StageOne, or on streams a Staged (staged.py)
        discard() if discard is not None else self.work.wait()


@dataclass(eq=False)
class RunAhead:
    """One engine's run-ahead of stage 1 (see [Note: the slow hop runs ahead])."""

    gather: Any  # HierarchicalGather (not imported: gather.py imports this module)
    max_bytes: int
    #: The engine's batched refill (``refill.py``): a batch it will make is pushed as one group.
    batcher: Any = None
    counters: RunAheadCounters = field(default_factory=RunAheadCounters)
    #: The groups gathered in two stages since the last push, in order (``ds_id`` tuples) and their params; at most
    #: ``MAX_TRACE`` (a window longer than that is not repeated whole: the plan is its tail, issued only if followed).
    trace: deque = field(default_factory=lambda: deque(maxlen=MAX_TRACE))
    pending: dict = field(default_factory=dict)
    #: The planned groups the budget held back at the push, by key in plan order: issued as fetches take pending
    #: ones (a dict: a fetch drops its own key in O(1), and a group planned twice is issued once).
    planned: dict = field(default_factory=dict)
    start: Start = Start.STEP_END
    #: A plan made at the step's end waits for the window's first gather (``start`` is ``Start.FIRST_FETCH``).
    armed: bool = False
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def record(self, params: Sequence[torch.nn.Parameter], unit: Sequence[torch.nn.Parameter]) -> None:
        """A two-stage gather of ``params`` (sorted by ``ds_id``), a part of ``unit`` (``gather.units``: the exact and
        the compressed part of one module's parameters of one dtype), was issued: the next push repeats the unit, split
        as the references are then ([Note: compressed groups run ahead])."""
        key = _key(unit)
        with self._lock:
            if not self.trace or self.trace[-1][0] != key:  # a unit's parts come one after the other
                self.trace.append((key, list(unit)))

    def take(self, params: Sequence[torch.nn.Parameter], lossy: bool = False) -> Optional[Pending]:
        """The pending stage 1 of exactly ``params`` as ``lossy`` as the fetch's (still in flight: the gather's queue
        waits for it before its stage 2, ``sequencer.py``), or ``None``."""
        key = _key(params)
        with self._lock:
            if self.armed:  # the window's first two-stage gather ([Note: from the window's first fetch])
                self.armed = False
                if next(iter(self.planned), None) == key:
                    self._issue(rolled=False)
                else:
                    self.planned = {}  # the window does not follow the plan: nothing is issued ahead in it
            pending = self.pending.pop(key, None)
            self.planned.pop(key, None)
            # the other pending compressed groups holding one of these parameters
            stale = _pop_overlapping_lossy(self.pending, key)
        if pending is not None and pending.lossy != lossy:  # the fetch's split differs: its own stage 1 crosses
            stale, pending = stale + [pending], None
        if pending is not None and not freshness.all_current(pending.params, pending.taken):
            # written after it was issued and no invalidation cancelled it: never read ([Note: freshness by
            # construction]); dropped as a cancelled group is, and the fetch crosses exactly
            pending.drop()
            self.counters.bump(stale=1)
            pending = None
        if stale:  # [Note: compressed groups run ahead]: this fetch's stage 1 rewrites their references
            for old in stale:
                old.drop()
            self.counters.bump(cancelled=len(stale))
        if pending is not None:
            self.counters.bump(used=1)
            self._issue(rolled=True)
        return pending

    def plan(self, trace: list) -> list[tuple[list, bool]]:
        """The groups the next window will gather in two stages, in order, each with whether it is compressed
        ([Note: what is pushed])."""
        batch = self.batcher.plan() if self.batcher is not None else []
        groups = self.gather.issue_groups(batch, count=False) if batch else []
        batched = {p.ds_id for p in batch}
        for _, unit in trace:
            rest = [p for p in unit if p.ds_id not in batched]
            if len(rest) == len(unit):
                groups += self.gather.split(unit, count=False)
            elif rest:  # the batch's parameters are hits after the refill: the module's fetch gathers the rest
                groups += self.gather.issue_groups(rest, per_module=True, count=False)
        return groups

    def push(self) -> None:
        """At a step's end, after its invalidation: stage 1 of the next window's groups (:meth:`plan`), in order."""
        self.cancel(None, unused=True)
        with self._lock:
            trace, self.trace = self.trace, deque(maxlen=MAX_TRACE)
        with self._lock:
            self.planned = {}
            for params, lossy in self.plan(trace):
                self.planned.setdefault(_key(params), (params, lossy))
            self.armed = self.start is Start.FIRST_FETCH
            if self.armed and len(self.planned) < 2:  # [Note: one group runs nothing ahead]
                self.planned, self.armed = {}, False
        if not self.armed:
            self._issue(rolled=False)

    def _issue(self, rolled: bool) -> None:
        """Issue stage 1 of the planned groups, in order, while the pending ones fit the budget.

        [Note: a rolling push] At the step's end the budget takes a prefix of the plan; each fetch that takes a
        pending group frees its bytes and issues the next planned groups, so a budget of a few groups keeps the
        inter-node link busy through the whole forward (the fetches of the last modules find their stage 1 done)
        without holding the whole model. Agreed: pushes happen at the step's end and inside fetches of the same
        groups, points every rank reaches in one order, and the plan and the statuses are the same on every rank.
        Fresh: a group's partitions are copied when it is issued, after every event before that point, and
        every later event cancels it (:meth:`cancel`)."""
        with self._lock:
            total = sum(v.nbytes for v in self.pending.values())
            issued = 0
            while self.planned:
                key, (params, lossy) = next(iter(self.planned.items()))
                if key in self.pending or not all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE and
                                                  p.ds_secondary_tensor is None for p in params) \
                        or [(_key(g), l) for g, l in self.gather.split(params, count=False)] != [(key, lossy)]:
                    del self.planned[key]
                    continue  # a hit next time (e.g. a frozen parameter filled since), gathered twice, or split anew
                layout = self.gather.layout  # held: the full group, or on streams its node bundle (staged.py)
                width = layout.nodes if self.gather.staged is not None else layout.dp_size
                nbytes = sum(p.ds_tensor.ds_numel for p in params) * width * params[0].element_size()
                if total + nbytes > self.max_bytes:
                    break  # a prefix of the plan, in order, on every rank alike
                del self.planned[key]
                total += nbytes
                # as for a stage 1 issued by its fetch: asynchronous (a compressed one encodes now, decodes when the
                # fetch's queue waits for it); the trace included
                taken = freshness.stamps(params)  # before the partitions are read
                self.pending[key] = Pending(key, *self.gather.ahead(params, lossy), nbytes, lossy, taken, tuple(params))
                issued += 1
                self.counters.bump(pushed_bytes=nbytes)
        self.counters.bump(**{"rolled" if rolled else "pushed": issued})

    def cancel(self, params: Optional[Iterable[torch.nn.Parameter]], unused: bool = False) -> None:
        """An invalidation event for ``params`` (``None``: every parameter): drop the pending groups holding any.
        ``unused``: the next push drops what no fetch took (counted: bytes that crossed for nothing)."""
        with self._lock:
            if params is None:
                dropped, self.pending, self.planned, self.armed = list(self.pending.values()), {}, {}, False
            else:
                ids = {p.ds_id for p in params}
                dropped = [v for k, v in self.pending.items() if ids.intersection(k)]
                for v in dropped:
                    del self.pending[v.key]
        for pending in dropped:  # every rank issued it: completes; nothing new is issued
            pending.drop()
        self.counters.bump(**{"unused" if unused else "cancelled": len(dropped)})

    def on_partition(self, param: torch.nn.Parameter, has_been_updated: bool) -> None:
        """``partition(has_been_updated=True)`` (``GatheredParameters`` edits): the partition changed."""
        if has_been_updated:
            self.cancel([param])

    def stats(self) -> dict:
        c = self.counters
        return {"param_push_groups": c.pushed, "param_push_rolled": c.rolled, "param_push_used": c.used,
                "param_push_cancelled": c.cancelled, "param_push_unused": c.unused,
                "param_push_bytes": c.pushed_bytes, "param_push_pending": len(self.pending), "param_push_stale": c.stale}


def build_runahead(config: Any, gather: Any, batcher: Any = None, trains: bool = True) -> Optional[RunAhead]:
    """The engine's run-ahead, ``None`` where it does not apply (see [Note: the slow hop runs ahead]): the push when
    ``param_push_bytes`` is set, else from the window's first fetch with ``param_runahead_bytes`` (0: off). An engine
    without an optimizer (``trains`` false) has no step's end to plan at, and every parameter it fetches twice is a
    cache hit: nothing to run ahead."""
    if not trains or gather is None or (gather.queue is None and not config.param_runahead_streams):
        return None
    budget, start = (config.param_push_bytes, Start.STEP_END) if config.param_push_bytes else \
        (config.param_runahead_bytes, Start.FIRST_FETCH)
    if not budget:
        return None
    if gather.queue is None:  # streams: [Note: the run-ahead on streams] (staged.py)
        gather.staged = StreamAhead(gather, device.side_stream("stage1"))
    gather.runahead = RunAhead(gather, budget, batcher=batcher, start=start)
    return gather.runahead
