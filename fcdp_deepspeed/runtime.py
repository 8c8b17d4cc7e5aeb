"""Per-engine FCDP runtime: attaches the node cache to DeepSpeed's stage-3 parameters.

[Note: how the cache plugs into DeepSpeed]
DeepSpeed 0.19.8's ZeRO++ hpZ path already gathers a parameter over a small group from a
per-rank "secondary" slice whenever ``param.ds_secondary_tensor`` is set (coordinator split, group
switch in ``all_gather_coalesced``, slice reassembly in ``AllGatherCoalescedHandle.wait``). FCDP
reuses that tested gather path and owns everything around it:

- the group: node ∩ DP group from the real topology (hpZ uses contiguous rank blocks);
- the storage: pooled host (or budgeted device) slots, filled on release (``_SecondaryHook``
  replaces ``Init._partition_param_sec`` on each ``zero.Init`` instance that partitioned the model,
  so no DeepSpeed-allocated device secondary is ever created);
- validity: entries are invalidated on every event that can change a value (see ``stage3.py``),
  including the ones hpZ misses (frozen params on checkpoint load, requires_grad flips).

The ``zero.Init`` instances are configured *after* the model and optimizer are built (retrofit), so
models built under ``zero.Init(config_dict_or_path=...)``, under a bare ``zero.Init()``, or handed
unpartitioned to ``deepspeed.initialize`` are all cached the same way.

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
from typing import Any, Iterable, Mapping, Optional

import psutil
import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import Init, ZeroParamStatus
from deepspeed.utils import logger

from fcdp_deepspeed.cache import CacheEntry, EntryState, NodeCache, Placement, SlotPool
from fcdp_deepspeed.config import FCDPConfig, FCDPConfigError
from fcdp_deepspeed.monitor import latest_monitor, monitor_events
from fcdp_deepspeed.placement import SlotRequest, plan_placement
from fcdp_deepspeed.stats import LEDGER, CacheCounters, CommCounters, fmt_bytes, format_stats_line
from fcdp_deepspeed.topology import Topology, TopologyError, build_topology, group_ranks


class StaleCacheError(RuntimeError):
    """Verification found a cached parameter that differs from its plain ZeRO-3 value."""


def init_owner(param: torch.nn.Parameter) -> Init:
    """The ``zero.Init`` instance that converted ``param``.

    Its per-param closures (``param.all_gather``) capture it as ``self``; we read it from there so
    models partitioned before :func:`fcdp_deepspeed.install` ran are found too.
    """
    fn = getattr(param.all_gather, "_fcdp_original", param.all_gather)
    code, cells = fn.__code__, fn.__closure__ or ()
    if "self" in code.co_freevars:
        owner = cells[code.co_freevars.index("self")].cell_contents
        if isinstance(owner, Init):
            return owner
    raise TypeError(f"cannot find the zero.Init instance that partitioned parameter ds_id={param.ds_id}")


class _SecondaryHook:
    """Stands in for ``Init._partition_param_sec`` on one ``zero.Init`` instance.

    DeepSpeed calls it from ``Init._partition`` for every partition of every param of that instance
    (release after use, ``partition(has_been_updated=True)`` after an in-place update). Params that
    belong to no FCDP cache are left alone: hpZ would otherwise allocate a device secondary for them.
    """

    def __init__(self, node_ranks: tuple[int, ...]) -> None:
        self.node_ranks = node_ranks
        self.caches: list[NodeCache] = []

    def __call__(self, param: torch.nn.Parameter, buffer: Any = None, has_been_updated: bool = False) -> None:
        for cache in self.caches:
            entry = cache.entry(param)
            if entry is not None:
                cache.on_partition(entry, has_been_updated)
                return


def _request(entry: CacheEntry) -> SlotRequest:
    return SlotRequest(entry.param.ds_id, entry.nbytes, frozen=not entry.param.requires_grad)


def _split_empty(params: list) -> tuple[list, list]:
    """Zero-size parameters have nothing to gather; DeepSpeed's gather crashes on them
    (``torch.cat`` of no partitions), so FCDP engines materialise them locally instead."""
    empty = [p for p in params if p.ds_numel == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
    for p in empty:
        p.ds_status = ZeroParamStatus.INFLIGHT  # the coordinator checks this right after issuing
    return [p for p in params if p.ds_numel != 0], empty


def _materialize_empty(params: list) -> None:
    for p in params:
        p.data = torch.empty(p.ds_shape, dtype=p.ds_tensor.dtype, device=get_accelerator().current_device_name())
        p.ds_status = ZeroParamStatus.AVAILABLE


class _VerifyingHandle:
    """Wraps a gather handle: completes zero-size parameters, and compares cache-served parameters
    with a plain gather (verify mode)."""

    def __init__(self, handle: Any, checks: list[tuple[CacheEntry, torch.Tensor]], empty: list) -> None:
        self.handle = handle
        self.checks = checks
        self.empty = empty
        self.done = False

    def wait(self, handle_dependency: bool = True) -> None:
        if self.handle is not None:
            self.handle.wait(handle_dependency=handle_dependency)
        if self.done:
            return
        self.done = True
        _materialize_empty(self.empty)
        for entry, reference in self.checks:
            served = entry.param.data.reshape(-1)
            expected = reference.narrow(0, 0, entry.param.ds_numel).to(served.dtype)
            if not torch.equal(served, expected):
                diff = (served.float() - expected.float()).abs().max().item()
                raise StaleCacheError(
                    f"fcdp verify: the cached value of parameter {entry.name!r} differs from its plain ZeRO-3 "
                    f"gather (max abs diff {diff:g}). A path changed the parameter without invalidating the cache; "
                    f"please report it with the training loop that triggered it.")


class FCDPRuntime:
    """Everything FCDP holds for one engine: topology, cache entries, pools and counters."""

    def __init__(self, config: FCDPConfig, ds_config: Mapping[str, Any], module: torch.nn.Module, dp_group: Any,
                 optimizer_params: Iterable[torch.nn.Parameter], param_names: Optional[Mapping] = None) -> None:
        self.config = config
        self.module = module
        self.dp_group = dp_group
        self.optimizer_ids = {p.ds_id for p in optimizer_params if hasattr(p, "ds_id")}
        self.param_names = dict(param_names or {})
        spp = ds_config.get("steps_per_print")
        self.steps_per_print = spp if isinstance(spp, int) and spp > 0 else None
        self.counters = CacheCounters()
        self.comm = CommCounters()
        self.topology: Optional[Topology] = None
        self.cache: Optional[NodeCache] = None
        self.uncached: dict[str, int] = {}  # reason -> params
        self.uncached_bytes = 0
        self._placement_revisited = False
        monitor = latest_monitor()  # the engine being built created it just before this optimizer
        self.monitor = monitor if monitor is not None and monitor.enabled else None

    # -- activation ---------------------------------------------------------------------------
    def activate(self) -> "FCDPRuntime":
        topo = build_topology(self.dp_group, self.config.ranks_per_node)
        self.topology = topo
        LEDGER.install(topo.node_of_rank)
        if topo.num_nodes == 1 and dist.get_rank() == 0:
            logger.warning("fcdp: all data-parallel ranks are on one node; there is no inter-node traffic to save. "
                           "Set fcdp.ranks_per_node to simulate several nodes.")
        self.cache = NodeCache(topo.rank_in_node, self.counters, checksums=self.config.verify_rate > 0)
        candidates = self._select_candidates(topo)
        hooks = {}
        for param in candidates:
            owner = init_owner(param)
            if id(owner) not in hooks:
                hooks[id(owner)] = self._retrofit(owner, topo)
            slot_numel = owner._aligned_size(param) // topo.ranks_per_node
            entry = CacheEntry(param=param, name=self._name(param), slot_numel=slot_numel,
                               start=slot_numel * topo.rank_in_node, dtype=param.ds_tensor.dtype)
            self.cache.entries[param.ds_id] = entry
            param.ds_zero_param_process_group = topo.group
            param.ds_secondary_tensor_group_size = topo.ranks_per_node
            param.ds_secondary_tensor_num_of_groups = topo.dp_size // topo.ranks_per_node
        for hook in hooks.values():
            hook.caches.append(self.cache)
        self._plan_and_allocate()
        for param in self._ds_params():
            self._wrap_param(param)
        return self

    def _ds_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if hasattr(p, "ds_id")]

    def _name(self, param: torch.nn.Parameter) -> str:
        return self.param_names.get(param, f"ds_id={param.ds_id}")

    def _select_candidates(self, topo: Topology) -> list[torch.nn.Parameter]:
        chosen = []
        group_cache: dict[int, tuple[int, ...]] = {}
        for param in self._ds_params():
            gid = id(param.ds_process_group)
            if gid not in group_cache:
                group_cache[gid] = group_ranks(param.ds_process_group)
            reason = None
            if param.ds_persist:
                reason = "persistent (stage3_param_persistence_threshold)"
            elif param.ds_numel == 0 or param.ds_numel < self.config.min_numel:
                reason = "smaller than fcdp.min_numel" if param.ds_numel else "zero-size"
            elif group_cache[gid] != topo.dp_ranks:
                reason = "partitioned over a different process group than the engine's DP group"
            elif hasattr(param.ds_tensor, "ds_quant_scale"):
                reason = "quantized"
            if reason is None:
                chosen.append(param)
            else:
                self.uncached[reason] = self.uncached.get(reason, 0) + 1
        return sorted(chosen, key=lambda p: p.ds_id)

    def _retrofit(self, owner: Init, topo: Topology) -> _SecondaryHook:
        """Point one ``zero.Init`` instance's hpZ machinery at the node group and our storage."""
        hook = owner.__dict__.get("_partition_param_sec")
        if isinstance(hook, _SecondaryHook):
            if hook.node_ranks != topo.node_ranks:
                raise TopologyError(f"this model is already cached by an FCDP engine with node group {hook.node_ranks}, "
                                    f"not {topo.node_ranks}; one zero.Init model cannot serve two layouts.")
            return hook
        if owner.zero_param_process_group is not None:
            raise FCDPConfigError("the model was partitioned by a zero.Init with a ZeRO++ hpZ group "
                                  "(zero_hpz_partition_size > 1). Fix: remove zero_hpz_partition_size from the config "
                                  "passed to zero.Init; fcdp builds its own node group.")
        if owner.dp_world_size != topo.dp_size:
            raise TopologyError(f"the model was partitioned over {owner.dp_world_size} ranks but the engine's data-parallel "
                                f"group has {topo.dp_size}. Fix: pass the same data_parallel_group/mpu to zero.Init and "
                                f"deepspeed.initialize.")
        owner.zero_param_process_group = topo.group
        owner.num_ranks_in_param_group = topo.ranks_per_node
        owner.rank_in_group = topo.rank_in_node
        owner.num_param_groups = topo.dp_size // topo.ranks_per_node
        hook = _SecondaryHook(topo.node_ranks)
        owner._partition_param_sec = hook
        return hook

    # -- planning -----------------------------------------------------------------------------
    def _budgets(self) -> tuple[int, int]:
        topo = self.topology
        host_node = self.config.host_budget_spec.resolve(psutil.virtual_memory().available, auto_fraction=0.5)
        host = host_node // topo.ranks_per_node
        device = 0
        if self.config.cache_device == "device":
            device = self.config.device_budget_spec.resolve(get_accelerator().available_memory(), auto_fraction=0.5)
        return host, device

    def _agree(self, flags: list[bool]) -> list[bool]:
        """Collective: a flag stays true only if it is true on every rank of the DP group."""
        if not flags:
            return []
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        t = t.to(get_accelerator().current_device_name())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.dp_group)
        return [bool(v) for v in t.cpu().tolist()]

    def _plan_and_allocate(self) -> None:
        cache = self.cache
        entries = list(cache.entries.values())  # ds_id order: identical on every rank
        host_budget, device_budget = self._budgets()
        plan = plan_placement([_request(e) for e in entries], self.config.cache_device, host_budget, device_budget)
        agreed = self._agree([plan[e.param.ds_id] is not None for e in entries])
        over_budget = [e for e, ok in zip(entries, agreed) if not ok]
        cache.disable(over_budget, "over budget")
        pin = self.config.pin_memory
        failed: list[CacheEntry] = []
        for placement in Placement:
            wanted = [e for e, ok in zip(entries, agreed) if ok and plan[e.param.ds_id] is placement]
            if wanted:
                pool = SlotPool(placement, pin=pin)
                failed += pool.reserve(wanted)
                cache.pools[placement] = pool
        alloc_ok = self._agree([e not in failed and e.state is not EntryState.DISABLED for e in entries])
        degraded = [e for e, ok in zip(entries, alloc_ok) if not ok and e.state is not EntryState.DISABLED]
        cache.disable(degraded, "allocation failed")
        for pool in cache.pools.values():
            if pool is not None:
                pool.release_unused(cache.entries.values())
        self.uncached_bytes = sum(e.nbytes for e in over_budget + degraded)
        if dist.get_rank() == 0:
            if over_budget:
                logger.warning(
                    f"fcdp: {len(over_budget)} parameters ({fmt_bytes(self.uncached_bytes)} per rank) do not fit the "
                    f"cache budget (host {fmt_bytes(host_budget)} per rank, device {fmt_bytes(device_budget)}) "
                    f"and take the plain ZeRO-3 path. Raise fcdp.host_budget"
                    f"{' or fcdp.device_budget' if self.config.cache_device == 'device' else ''} to cache them.")
            if degraded:
                logger.warning(f"fcdp: cache allocation failed for {len(degraded)} parameters on at least one rank; "
                               f"they take the plain ZeRO-3 path on every rank. Training continues unchanged.")

    def _promote_to_device(self) -> None:
        """``auto`` mode, first step boundary: move host slices to the accelerator within the headroom
        the first step left unused (total minus its peak), so the cache never takes memory a step
        needed. Placement only: which parameters are cached does not change, so no agreement is needed.
        """
        acc = get_accelerator()
        headroom = max(0, acc.total_memory() - acc.max_memory_allocated())
        budget = min(headroom, self.config.device_budget_spec.resolve(headroom, auto_fraction=0.5))
        host = [e for e in self.cache.entries.values() if e.placement is Placement.HOST]
        plan = plan_placement([_request(e) for e in host], "device", host_budget=0, device_budget=budget)
        chosen = [e for e in host if plan[e.param.ds_id] is Placement.DEVICE]
        if not chosen:
            return
        pool = self.cache.pools[Placement.DEVICE] or SlotPool(Placement.DEVICE, pin=False)
        self.cache.pools[Placement.DEVICE] = pool
        moved = self.cache.move(chosen, pool)
        self.cache.pools[Placement.HOST].release_unused(self.cache.entries.values())
        if dist.get_rank() == 0:
            logger.info(f"fcdp: moved {len(moved)} cached slices ({fmt_bytes(sum(e.nbytes for e in moved))}) to "
                        f"the accelerator (headroom after step 1: {fmt_bytes(headroom)}, budget {fmt_bytes(budget)})")

    # -- per-parameter gather wrappers --------------------------------------------------------
    def _wrap_param(self, param: torch.nn.Parameter) -> None:
        if hasattr(param.all_gather_coalesced, "_fcdp_original"):
            return
        runtime = self
        original_coalesced, original_gather = param.all_gather_coalesced, param.all_gather

        def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False):
            params, empty = _split_empty(list(params))
            hits, checks = runtime._count_and_verify(params)
            handle = None
            if params:
                with LEDGER.attribute(runtime.comm), runtime.cache.staged(hits):
                    handle = original_coalesced(params, safe_mode=safe_mode, quantize=quantize)
            if checks or empty:
                return _VerifyingHandle(handle, checks, empty)
            return handle

        def all_gather(param_list=None, async_op: bool = False, hierarchy: int = 0):
            rest, empty = _split_empty(list(param_list) if param_list is not None else [param])
            _materialize_empty(empty)
            if not rest:
                return [] if async_op else None
            with LEDGER.attribute(runtime.comm):
                return original_gather(param_list=rest, async_op=async_op, hierarchy=hierarchy)

        all_gather_coalesced._fcdp_original = original_coalesced
        all_gather._fcdp_original = original_gather
        param.all_gather_coalesced = all_gather_coalesced
        param.all_gather = all_gather

    def _count_and_verify(
            self, params: list[torch.nn.Parameter]) -> tuple[list[CacheEntry], list[tuple[CacheEntry, torch.Tensor]]]:
        """Count hits/misses of one gather; return the hit entries and the verification references.

        Verification samples by each entry's own hit count, which is identical on every rank, so the
        extra plain gathers are collective on all of them (see [Note: threads] for ordering)."""
        hit_entries: list[CacheEntry] = []
        misses = uncached = 0
        to_check: list[CacheEntry] = []
        rate = self.config.verify_rate
        for param in sorted(params, key=lambda p: p.ds_id):  # same order on every rank
            entry = self.cache.entry(param)
            if entry is None or entry.state is EntryState.DISABLED:
                uncached += 1
            elif self.cache.is_hit(entry):
                hit_entries.append(entry)
                entry.hits += 1
                if rate > 0 and math.floor(entry.hits * rate) != math.floor((entry.hits - 1) * rate):
                    to_check.append(entry)
            else:
                misses += 1
        self.counters.bump(hits=len(hit_entries), misses=misses, uncached_fetches=uncached)
        return hit_entries, [(e, self._reference_gather(e)) for e in to_check]

    def _reference_gather(self, entry: CacheEntry) -> torch.Tensor:
        """Plain ZeRO-3 gather of the primary partitions (collective over the DP group)."""
        param = entry.param
        if entry.checksum is not None and float(entry.slot.double().sum()) != entry.checksum:
            raise StaleCacheError(f"fcdp verify: the cached slice of parameter {entry.name!r} changed since it was "
                                  f"filled (memory corruption or a racing write into the cache).")
        device = get_accelerator().current_device_name()
        shard = param.ds_tensor.to(device)
        world = dist.get_world_size(group=param.ds_process_group)
        out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=device)
        with LEDGER.attribute(self.comm):
            dist.all_gather_into_tensor(out, shard, group=param.ds_process_group)
        self.counters.bump(verified_hits=1)
        return out

    # -- invalidation events ------------------------------------------------------------------
    def invalidate_params(self, params: Iterable[torch.nn.Parameter], reason: str) -> int:
        entries = [e for e in (self.cache.entry(p) for p in params) if e is not None]
        return self.cache.invalidate(entries, reason)

    def invalidate_changed(self) -> None:
        """Optimizer step boundary: drop every entry the step may have changed.

        Kept: frozen params (``keep_frozen``) the optimizer does not own. A param unfrozen between
        steps requires grad now, so it is dropped too and never served as a stale "frozen" value.
        """
        stale = [e for e in self.cache.entries.values()
                 if e.param.requires_grad or e.param.ds_id in self.optimizer_ids or not self.config.keep_frozen]
        self.cache.invalidate(stale, "optimizer_step")

    def flush(self, reason: str) -> None:
        self.cache.invalidate(list(self.cache.entries.values()), reason)

    def on_step_end(self) -> None:
        self.counters.bump(optimizer_steps=1)
        if self.config.cache_device == "auto" and not self._placement_revisited:
            self._placement_revisited = True
            self._promote_to_device()
        step = self.counters.optimizer_steps
        if self.steps_per_print and step % self.steps_per_print == 0:
            stats = self.stats()
            if self.monitor is not None:
                self.monitor.write_events(monitor_events(stats, step))
            if dist.get_rank() == 0:
                logger.info(format_stats_line(stats))

    # -- reporting ----------------------------------------------------------------------------
    def stats(self) -> dict:
        cache, topo, c = self.cache, self.topology, self.counters
        host_pool, device_pool = cache.pools[Placement.HOST], cache.pools[Placement.DEVICE]
        out = {
            **self.comm.allgather_summary(),
            "cache_hits": c.hits,
            "cache_misses": c.misses,
            "uncached_fetches": c.uncached_fetches,
            "cache_fills": c.fills,
            "cache_refreshes": c.refreshes,
            "invalidations": dict(c.invalidations),
            "verified_hits": c.verified_hits,
            "h2d_async_copies": c.staged_copies,
            "h2d_async_bytes": c.staged_bytes,
            "optimizer_steps": c.optimizer_steps,
            "host_cache_bytes": cache.held_bytes(Placement.HOST),
            "device_cache_bytes": cache.held_bytes(Placement.DEVICE),
            "host_pool_bytes": host_pool.nbytes if host_pool else 0,
            "device_pool_bytes": device_pool.nbytes if device_pool else 0,
            "pinned_pool_bytes": host_pool.pinned_nbytes if host_pool else 0,
            "pool_allocations": sum(p.allocations for p in cache.pools.values() if p is not None),
            "host_pool_allocations": host_pool.allocations if host_pool else 0,
            "device_pool_allocations": device_pool.allocations if device_pool else 0,
            "cached_params": sum(1 for e in cache.entries.values() if e.state is not EntryState.DISABLED),
            "uncached_params": sum(self.uncached.values()) + sum(
                1 for e in cache.entries.values() if e.state is EntryState.DISABLED),
            "uncached_bytes": self.uncached_bytes,
            "uncached_reasons": dict(self.uncached),
            "ranks_per_node": topo.ranks_per_node,
            "num_nodes": topo.num_nodes,
            "node_ranks": list(topo.node_ranks),
            "peak_device_memory_bytes": get_accelerator().max_memory_allocated(),
        }
        out.update(self.comm.snapshot())
        return out
