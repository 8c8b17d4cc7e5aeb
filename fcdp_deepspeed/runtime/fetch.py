"""The fetch path: per-parameter gather wrappers that count hits and misses, serve hits from the node
cache, verify them against plain ZeRO-3 (``verify`` mode), and complete zero-size parameters.

[Note: threads]
Backward fetches and releases can run on autograd worker threads (one per device), while the
main thread runs forward, the optimizer step and checkpoint events. What is shared and why it is
safe:

- entry states and ``param.ds_secondary_tensor``: changed only inside ``NodeCache`` under its
  re-entrant lock (fills on release, invalidations, staging around one gather);
- the DeepSpeed coordinator already serialises fetches of one module (its leaf-module lock) and a
  parameter is INFLIGHT between issue and wait, so it is never filled while being gathered: fills
  happen only in ``partition()`` of an AVAILABLE parameter;
- counters (``CacheCounters``, ``CommCounters``): every update holds the object's lock;
- collective attribution (``LEDGER.attribute``): a thread-local stack, so a backward thread's
  collectives are never attributed to another engine;
- invalidation at step boundaries and checkpoint events runs on the main thread when no fetch is in
  flight (DeepSpeed partitions every parameter first), so it cannot race a gather.
Hit/miss decisions read the entry state once per gather, under the lock, before the collective
is issued; all ranks make them at the same logical point, so they agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import MultipleAllGatherHandles, ZeroParamStatus
from deepspeed.utils import logger

from fcdp_deepspeed.machine import device
from fcdp_deepspeed.reporting import timeline
from fcdp_deepspeed.reporting.stats import LEDGER, CacheCounters, CommCounters
from fcdp_deepspeed.reporting.timeline import PhaseClock
from fcdp_deepspeed.runtime.gather import HierarchicalGather
from fcdp_deepspeed.runtime.refill import MissBatcher
from fcdp_deepspeed.runtime.routing import Route, split_fetch
from fcdp_deepspeed.storage import freshness
from fcdp_deepspeed.storage.cache import SLOT_OWNER, CacheEntry, EntryState, NodeCache


class StaleCacheError(RuntimeError):
    """Verification found a cached parameter that differs from its plain ZeRO-3 value."""


#: Attribute of a wrapper that holds the DeepSpeed function it replaced.
_ORIGINAL = "_fcdp_original"
#: Attribute of a wrapper that only attributes bytes (a plain engine's, see :func:`count_gathers`).
_COUNTING_ONLY = "_fcdp_counting_only"
#: Attribute of an FCDP wrapper: the :class:`FetchPath` it belongs to.
_FETCH = "_fcdp_fetch"


def _lead(params: list) -> Optional[torch.nn.Parameter]:
    """The parameter of a fetch whose entry point serves it: the lowest ``ds_id``, the same on every rank."""
    return min(params, key=lambda p: p.ds_id) if params else None


def unwrapped(fn: Callable) -> Callable:
    """The DeepSpeed gather function that :meth:`FetchPath.wrap` replaced (``fn`` if unwrapped)."""
    return getattr(fn, _ORIGINAL, fn)


def count_gathers(param: torch.nn.Parameter, comm: CommCounters) -> None:
    """A plain ZeRO-3 engine's parameter: attribute its gathers to ``comm`` (once; FCDP engines wrap
    with :meth:`FetchPath.wrap`, which also attributes). Nothing else changes."""
    if hasattr(param.all_gather_coalesced, _ORIGINAL):
        return
    original_coalesced, original_gather = param.all_gather_coalesced, param.all_gather

    def all_gather_coalesced(*args: Any, **kwargs: Any) -> Any:
        with LEDGER.attribute(comm):
            return original_coalesced(*args, **kwargs)

    def all_gather(*args: Any, **kwargs: Any) -> Any:
        with LEDGER.attribute(comm):
            return original_gather(*args, **kwargs)

    for wrapper, original in ((all_gather_coalesced, original_coalesced), (all_gather, original_gather)):
        setattr(wrapper, _ORIGINAL, original)
        setattr(wrapper, _COUNTING_ONLY, True)
    param.all_gather_coalesced = all_gather_coalesced
    param.all_gather = all_gather


def _split_empty(params: list) -> tuple[list, list]:
    """Zero-size parameters have nothing to gather; DeepSpeed's gather crashes on them
    (``torch.cat`` of no partitions), so FCDP engines materialise them locally instead."""
    empty = [p for p in params if p.ds_numel == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
    for p in empty:
        p.ds_status = ZeroParamStatus.INFLIGHT  # the coordinator checks this right after issuing
    return [p for p in params if p.ds_numel != 0], empty


def _materialize_empty(params: list) -> None:
    for p in params:
        p.data = device.accel_empty(0, p.ds_tensor.dtype).view(p.ds_shape)
        p.ds_status = ZeroParamStatus.AVAILABLE


#: One verification: (parameter name, parameter, flat-gather reference, what served the parameter).
Check = tuple[str, torch.nn.Parameter, torch.Tensor, str]


class _VerifyingHandle:
    """Wraps a gather handle: completes zero-size parameters, and compares cache-served and
    hierarchically gathered parameters with DeepSpeed's flat gather (verify mode)."""

    def __init__(self, handle: Any, checks: list[Check], empty: list) -> None:
        self.handle = handle
        self.checks = checks
        self.empty = empty

    def wait(self, handle_dependency: bool = True) -> None:
        if self.handle is not None:
            self.handle.wait(handle_dependency=handle_dependency)
        _materialize_empty(self.empty)
        self.empty = []
        # a per-module gather completes only the parts waited for now (gather.PerModuleHandle): check those
        ready = [c for c in self.checks if c[1].ds_status is ZeroParamStatus.AVAILABLE]
        self.checks = [c for c in self.checks if c[1].ds_status is not ZeroParamStatus.AVAILABLE]
        for name, param, reference, source in ready:
            served = param.data.reshape(-1)
            expected = reference.narrow(0, 0, param.ds_numel).to(served.dtype)
            if not torch.equal(served, expected):
                diff = (served.float() - expected.float()).abs().max().item()
                why = ("A path changed the parameter without invalidating the cache" if source == "cached" else
                       "The hierarchical gather put partitions in the wrong place (fcdp.param_gather = \"flat\" "
                       "avoids it)")
                raise StaleCacheError(
                    f"fcdp verify: the {source} value of parameter {name!r} differs from its plain ZeRO-3 "
                    f"gather (max abs diff {diff:g}). {why}; please report it with the training loop that "
                    f"triggered it.")


class _TimedHandle:
    """Times a fetch handle's ``wait`` as the fetch's phase (forward gather or backward refill, ``timeline.py``)."""

    def __init__(self, handle: Any, clock: PhaseClock) -> None:
        self.handle = handle
        self.clock = clock

    def wait(self, handle_dependency: bool = True) -> None:
        with timeline.waiting(timeline.fetch_phase(), self.clock):
            self.handle.wait(handle_dependency=handle_dependency)


@dataclass(eq=False)
class FetchPath:
    """Serves one engine's gathers. Its only state is each entry's hit count (``entry.hits``), which
    drives verify sampling; it counts into the engine's counters."""

    cache: NodeCache
    counters: CacheCounters
    comm: CommCounters
    #: Fraction of cache hits (and of hierarchically gathered misses) re-gathered the plain way and compared (0 = off).
    verify_rate: float
    #: The two-stage gather of misses (``fcdp.param_gather``); ``None``: DeepSpeed's flat ring.
    gather: Optional[HierarchicalGather] = None
    #: Refills small stale parameters together at the first miss (``fcdp.miss_batch_bytes``); ``None``: off.
    batcher: Optional[MissBatcher] = None
    #: Parameters gathered in two stages so far (drives verify sampling of misses; identical on every rank).
    miss_gathers: int = 0
    #: The engine's host seconds per phase: each fetch's issue and wait (``timeline.py``).
    clock: Optional[PhaseClock] = None

    def wrap(self, param: torch.nn.Parameter) -> None:
        """Replace ``param``'s two gather entry points (once; the originals stay reachable)."""
        if hasattr(param.all_gather_coalesced, _ORIGINAL) and not hasattr(param.all_gather_coalesced, _COUNTING_ONLY):
            return
        fetch = self
        # a plain engine may have counted this parameter first: the cache path replaces that wrapper
        original_coalesced, original_gather = unwrapped(param.all_gather_coalesced), unwrapped(param.all_gather)

        def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False):
            params = list(params)
            lead = _lead(params)
            if lead is not None and getattr(lead.all_gather_coalesced, _FETCH, None) is not fetch:
                # [Note: two engines over one model] another engine's fetch path has the lowest ds_id of this
                # fetch: it serves the fetch on every rank alike (DeepSpeed calls the first of a set's members)
                return lead.all_gather_coalesced(params, safe_mode=safe_mode, quantize=quantize)
            freshness.gathered(params)
            params, empty = _split_empty(params)
            hits, checks = fetch.count_and_verify(params)
            handle = None
            if params:
                with LEDGER.attribute(fetch.comm), timeline.waiting(timeline.fetch_phase(), fetch.clock):
                    handle, miss_checks = fetch.issue(params, hits, original_coalesced, safe_mode, quantize)
                checks += miss_checks
            if checks or empty:
                handle = _VerifyingHandle(handle, checks, empty)
            return _TimedHandle(handle, fetch.clock) if handle is not None and fetch.clock is not None else handle

        def all_gather(param_list=None, async_op: bool = False, hierarchy: int = 0):
            rest, empty = _split_empty(list(param_list) if param_list is not None else [param])
            freshness.gathered(rest)
            _materialize_empty(empty)
            if not rest:
                return [] if async_op else None
            with LEDGER.attribute(fetch.comm):
                return original_gather(param_list=rest, async_op=async_op, hierarchy=hierarchy)

        setattr(all_gather_coalesced, _ORIGINAL, original_coalesced)
        setattr(all_gather_coalesced, _FETCH, fetch)
        setattr(all_gather, _ORIGINAL, original_gather)
        param.all_gather_coalesced = all_gather_coalesced
        param.all_gather = all_gather

    def issue(self, params: list, hits: list[CacheEntry], original: Callable, safe_mode: bool,
              quantize: bool) -> tuple[Any, list[Check]]:
        """Issue one coalesced gather: hits through DeepSpeed's node-group (hpZ) path, misses through
        the two-stage gather where it applies, else DeepSpeed's flat ring (the reason is counted), each
        part on its own and in an order every rank agrees on ([Note: one fetch, several collectives])."""
        misses = [p for p in params if p.ds_secondary_tensor is None]
        # qwZ-quantized gathers are refused by the config; a quantized call keeps its own path regardless
        refilled = self.batcher.refill() if self.batcher is not None and misses and not quantize else []
        batched = {p.ds_id for p in refilled}
        gathered = [p for p in misses if p.ds_id in batched]  # the batch filled their slots: hits now
        hits = hits + [e for e in map(self.cache.entry, gathered) if e is not None]
        handles, two_stage = [], []
        for part in split_fetch(params, self.gather, quantize):
            if part.route is Route.TWO_STAGE:
                handles.append(self.gather.issue(part.params, safe_mode=safe_mode, per_module=True))
                two_stage += part.params
                continue
            if part.reason:
                self._fall_back(part.reason, len(part.params))
            with self.cache.staged(hits if part.route is Route.SERVED else ()):
                handles.append(original(list(part.params), safe_mode=safe_mode, quantize=quantize))
        if two_stage:
            self.counters.bump(hierarchical_gathers=len(two_stage))
        handle = handles[0] if len(handles) == 1 else MultipleAllGatherHandles(handles)
        return handle, self._sample(gathered + two_stage)

    def _sample(self, params: list) -> list[Check]:
        """Verify references for a sample of two-stage gathered parameters (``verify`` mode)."""
        checks = []
        rate = self.verify_rate
        for p in sorted(params, key=lambda q: q.ds_id):
            self.miss_gathers += 1
            if self._lossy(p):
                continue  # a compressed reconstruction (fcdp.param_compression): not ZeRO-3's value by design
            if rate > 0 and math.floor(self.miss_gathers * rate) != math.floor((self.miss_gathers - 1) * rate):
                entry = self.cache.entry(p)
                checks.append((entry.name if entry else f"ds_id={p.ds_id}", p, flat_reference(p), "two-stage gathered"))
        self.counters.bump(verified_gathers=len(checks))
        return checks

    def _lossy(self, param: torch.nn.Parameter) -> bool:
        compression = self.gather.compression if self.gather is not None else None
        return compression is not None and compression.lossy(param)  # compressed: verify compares exact values only

    def _fall_back(self, reason: str, count: int) -> None:
        if self.counters.gather_fell_back(reason, count) and dist.get_rank() == 0:
            logger.warning(f"fcdp: param_gather hierarchical: {count} parameter(s) take DeepSpeed's flat all-gather "
                           f"({reason}); later ones for the same reason are counted in get_stats "
                           f"(param_gather_fallbacks).")

    def count_and_verify(
            self, params: list[torch.nn.Parameter]) -> tuple[list[CacheEntry], list[Check]]:
        """Count hits/misses of one gather; return the hit entries and the verification references.

        Verification samples by each entry's own hit count, which is identical on every rank, so the
        extra plain gathers are collective on all of them (see [Note: threads] for ordering)."""
        hit_entries: list[CacheEntry] = []
        misses = uncached = 0
        to_check: list[CacheEntry] = []
        rate = self.verify_rate
        for param in sorted(params, key=lambda p: p.ds_id):  # same order on every rank
            entry = self.cache.entry(param)
            if entry is None and param.ds_secondary_tensor is not None:
                # another engine's slot ([Note: two engines over one model]): checked at use by its own cache
                owner = getattr(param, SLOT_OWNER, None)
                foreign = owner.entry(param) if owner is not None else None
                if foreign is not None:
                    owner.is_hit(foreign)
            if entry is None or entry.state is EntryState.DISABLED:
                uncached += 1
            elif self.cache.is_hit(entry):
                hit_entries.append(entry)
                entry.hits += 1
                if rate > 0 and math.floor(entry.hits * rate) != math.floor((entry.hits - 1) * rate) \
                        and not self._lossy(param):  # a slot filled from a compressed reconstruction
                    to_check.append(entry)
            else:
                misses += 1
        self.counters.bump(hits=len(hit_entries), misses=misses, uncached_fetches=uncached)
        return hit_entries, [(e.name, e.param, self._reference_gather(e), "cached") for e in to_check]

    def _reference_gather(self, entry: CacheEntry) -> torch.Tensor:
        """Plain ZeRO-3 gather of a cached parameter, after checking its slot's checksum."""
        device.host_wait(entry.ready)  # verify is a debug mode: the host reads the slot after its fill
        if entry.checksum is not None and float(entry.slot.double().sum()) != entry.checksum:
            raise StaleCacheError(f"fcdp verify: the cached slice of parameter {entry.name!r} changed since it was "
                                  f"filled (memory corruption or a racing write into the cache).")
        with LEDGER.attribute(self.comm):
            out = flat_reference(entry.param)
        self.counters.bump(verified_hits=1)
        return out


def flat_reference(param: torch.nn.Parameter) -> torch.Tensor:
    """Plain ZeRO-3 gather of the primary partitions (collective over the parameter's DP group)."""
    shard = device.to_accel(param.ds_tensor)  # host-resident under offload_param
    world = dist.get_world_size(group=param.ds_process_group)
    out = device.accel_empty(shard.numel() * world, shard.dtype)
    dist.all_gather_into_tensor(out, shard, group=param.ds_process_group)
    return out
