"""Budgets and slots: which entries get a slot, in which pool, agreed across the data-parallel group.

The policy is the pure :func:`~fcdp_deepspeed.storage.placement.plan_placement`; this module resolves the
budgets it is given, allocates the pools, and makes the *cached or not* outcome agree on every rank
(hit/miss decides which collective runs). Placement itself may differ per rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepspeed import comm as dist
from deepspeed.utils import logger

from fcdp_deepspeed.config import Budget, FCDPConfig
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.machine.topology import Topology
from fcdp_deepspeed.reporting.stats import fmt_bytes
from fcdp_deepspeed.storage import memory
from fcdp_deepspeed.storage.cache import CacheEntry, EntryState, NodeCache, Placement, SlotPool
from fcdp_deepspeed.storage.placement import SlotRequest, placement_order, plan_placement


def _request(entry: CacheEntry) -> SlotRequest:
    return SlotRequest(entry.param.ds_id, entry.nbytes, frozen=not entry.param.requires_grad)


def _in_placement_order(entries: list[CacheEntry]) -> list[CacheEntry]:
    by_key = {e.param.ds_id: e for e in entries}
    return [by_key[r.key] for r in placement_order([_request(e) for e in entries])]


def host_budget_per_node(spec: Budget, limit: memory.MemoryLimit) -> tuple[int, bool]:
    """A host budget resolved against the usable limit (percentages of it; sizes capped by it).
    Returns ``(bytes, capped)``: ``capped`` when an explicit size exceeded what the limit allows."""
    usable = memory.usable_host(limit)
    wanted = spec.resolve(usable, auto_fraction=0.5)
    return min(wanted, usable), wanted > usable


def fit_prefix(cost: Callable[[list], int], ordered: list, budget: int) -> int:
    """How many of ``ordered`` (placement order) fit ``budget`` under ``cost`` (e.g. a pool's, chunking
    and pinned rounding counted). The cost of a prefix only grows: binary search."""
    lo, hi = 0, len(ordered)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(ordered[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(eq=False)
class Allocation:
    """One engine's slot allocation, planned once at activation (the accelerator modes move slices later,
    ``runtime.promotion``)."""

    config: FCDPConfig
    dp_group: Any
    topology: Topology
    cache: NodeCache
    #: Per-rank bytes of the entries that got no slot (over budget, or allocation failed somewhere).
    uncached_bytes: int = 0
    #: Entries left out at planning: over the budgets resolved below, or their slot failed on some rank.
    over_budget: int = 0
    degraded: int = 0
    host_budget: int = 0
    device_budget: int = 0
    #: Host memory limit the host budget was resolved against (cgroup, SLURM or psutil, named).
    host_limit: memory.MemoryLimit | None = None
    #: Resident bytes of every rank on this node when the budgets were resolved (SLURM's limit is per node).
    node_rss: int = 0

    def _node_rss(self) -> int:
        """Collective over the world: the resident memory of every rank on this node."""
        import psutil
        world, rank = dist.get_world_size(), dist.get_rank()
        mine = [0] * world
        mine[rank] = psutil.Process().memory_info().rss
        t = device.small_to_accel(mine, torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        nodes = self.topology.node_of_rank
        return memory.node_resident_bytes(device.small_to_host(t), nodes, nodes[rank])

    def _budgets(self) -> tuple[int, int]:
        """Per-rank host budget, and 0 for the accelerator: the accelerator modes start on the host and move
        after a measured step ([Note: device budgets come from a measured step])."""
        topo = self.topology
        self.node_rss = self._node_rss()
        self.host_limit = memory.host_limit(used_bytes=self.node_rss)
        host_node, capped = host_budget_per_node(self.config.host_budget_spec, self.host_limit)
        if capped and dist.get_rank() == 0:
            logger.warning(f"fcdp: fcdp.host_budget {self.config.host_budget} exceeds the host memory this node may "
                           f"still take ({self.host_limit.describe()}, less a margin of "
                           f"{fmt_bytes(memory.host_margin(self.host_limit.bytes))}); using {fmt_bytes(host_node)}.")
        return host_node // topo.ranks_per_node, 0

    def agree(self, flags: list[bool]) -> list[bool]:
        """Collective: a flag stays true only if it is true on every rank of the DP group (planning and
        checkpoint loads only: a blocking control read)."""
        return self._agree(flags)

    def _agree(self, flags: list[bool]) -> list[bool]:
        """Collective: a flag stays true only if it is true on every rank of the DP group."""
        if not flags:
            return []
        t = device.small_to_accel([1 if f else 0 for f in flags], torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.dp_group)
        return [bool(v) for v in device.small_to_host(t)]

    def plan_and_allocate(self) -> None:
        """Collective: place every entry within the budgets and reserve its slot; entries over budget
        or whose slot failed on any rank are disabled on every rank (one warning each, rank 0)."""
        cache = self.cache
        entries = list(cache.entries.values())  # ds_id order: identical on every rank
        host_budget, device_budget = self.host_budget, self.device_budget = self._budgets()
        plan = plan_placement([_request(e) for e in entries], self.config.cache_device, host_budget, device_budget)
        self._count_pool_costs(entries, plan)
        agreed = self._agree([plan[e.param.ds_id] is not None for e in entries])
        over_budget = [e for e, ok in zip(entries, agreed) if not ok]
        cache.disable(over_budget, "over budget")
        pin = self.config.pin_memory
        failed: list[CacheEntry] = []
        kept = {id(e) for e, ok in zip(entries, agreed) if ok}
        ordered = _in_placement_order(entries)  # the order _count_pool_costs priced the host pool in
        for placement in Placement:
            wanted = [e for e in ordered if id(e) in kept and plan[e.param.ds_id] is placement]
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
        self.over_budget, self.degraded = len(over_budget), len(degraded)
        if entries and len(over_budget) + len(degraded) == len(entries):
            return  # nothing is cached: warn_if_nothing_cached says so once, with every reason
        if dist.get_rank() == 0:
            if over_budget:
                logger.warning(
                    f"fcdp: {len(over_budget)} parameters ({fmt_bytes(self.uncached_bytes)} per rank) do not fit the "
                    f"cache budget (host {fmt_bytes(host_budget)} per rank, from {self.host_limit.describe()} less a "
                    f"margin) and take the plain ZeRO-3 path. Raise fcdp.host_budget to cache them"
                    f"{' (the accelerator modes start on the host and move after step 2)' if device_budget == 0 and self.config.cache_device != 'host' else ''}.")
            if degraded:
                logger.warning(f"fcdp: cache allocation failed for {len(degraded)} parameters on at least one rank; "
                               f"they take the plain ZeRO-3 path on every rank. Training continues unchanged.")

    def _count_pool_costs(self, entries: list[CacheEntry], plan: dict) -> None:
        """Un-place the host entries (last in placement order first) whose chunking and pinned rounding
        would take the pool past the host budget (``plan_placement`` counts slot bytes only)."""
        host = [e for e in _in_placement_order(entries) if plan[e.param.ds_id] is Placement.HOST]
        fits = fit_prefix(SlotPool(Placement.HOST, pin=self.config.pin_memory).cost, host, self.host_budget)
        for e in host[fits:]:
            plan[e.param.ds_id] = None

    def log_pinning(self) -> None:
        """One line (rank 0): how much pinned host memory the pool took and how long pinning and zeroing took,
        or one warning when the pool is pageable on an accelerator that could pin ([Note: pageable host memory])."""
        pool = self.cache.pools[Placement.HOST]
        if pool is None or dist.get_rank() != 0:
            return
        if pool.pin:
            logger.info(f"fcdp: allocated {fmt_bytes(pool.nbytes)} of host memory for the cache pool "
                        f"({fmt_bytes(pool.pinned_nbytes)} page-locked, {len(pool.chunks)} chunks) in "
                        f"{pool.alloc_seconds:.2f} s, pinning and zeroing included")
        elif device.pins_host_memory():
            logger.warning(pageable_warning("fcdp.pin_memory is false"))


def offloaded_pageable(ds_config: dict) -> bool:
    """Whether DeepSpeed keeps the parameter partitions in pageable host memory (``offload_param`` to the CPU
    with its ``pin_memory``, false by default)."""
    offload = (ds_config.get("zero_optimization") or {}).get("offload_param") or {}
    return str(offload.get("device", "none")) == "cpu" and not offload.get("pin_memory", False)


def pageable_warning(what: str) -> str:
    """[Note: pageable host memory] A copy between pageable host memory and the accelerator is synchronous for
    the host: every cache fill, staged hit and node-buffer accumulation then waits for the accelerator."""
    return (f"fcdp: {what}: FCDP's host memory is pageable, so every cache fill, staged cache hit and node-buffer "
            f"accumulation is a synchronous copy (the host waits for the accelerator each time). Pin it "
            f"(fcdp.pin_memory: true, the default) unless host memory cannot be page-locked.")


#: Settings to change, by why an engine's parameters got no cache entry (``Attachment.uncached``).
_FIXES = {
    "persistent (stage3_param_persistence_threshold)": "lower zero_optimization.stage3_param_persistence_threshold "
    "(parameters of at most that many elements stay gathered and are never cached; DeepSpeed's default is "
    "100000, 0 lets every parameter be cached)",
    "smaller than fcdp.min_numel": "lower fcdp.min_numel",
    "zero-size": "nothing (zero-size parameters have nothing to gather)",
    "partitioned over a different process group than the engine's DP group":
        "pass the same data_parallel_group/mpu to zero.Init and deepspeed.initialize",
    "quantized": "set zero_optimization.zero_quantized_weights false",
}


def warn_if_nothing_cached(attachment: Any, allocation: Allocation) -> None:
    """One warning (rank 0) when an enabled engine caches no parameter at all, naming each reason
    and the setting that changes it. Why: every gather then crosses nodes as in plain ZeRO-3 (the gradient modes
    still run), and a user who enabled the block would otherwise only see it in ``get_stats``' ``uncached_reasons``."""
    if any(e.state is not EntryState.DISABLED for e in allocation.cache.entries.values()):
        return
    if allocation.topology.num_nodes == 1:
        return  # attach said so, once
    reasons = [f"{count} {reason}: {_FIXES.get(reason, 'see uncached_reasons in get_stats')}"
               for reason, count in sorted(attachment.uncached.items())]
    if allocation.over_budget:
        reasons.append(f"{allocation.over_budget} over the cache budget (host {fmt_bytes(allocation.host_budget)} per "
                       f"rank): raise fcdp.host_budget")
    if allocation.degraded:
        reasons.append(f"{allocation.degraded} whose cache allocation failed on some rank: free host memory or "
                       f"lower fcdp.host_budget")
    if not reasons:
        reasons.append("the model has no ZeRO-3 partitioned parameters")
    if dist.get_rank() == 0:
        logger.warning("fcdp: enabled, but the cache holds no parameter: every gather crosses nodes (the gradient modes on "
                       "the 'fcdp: ON' line still run). "
                       "Parameters not cached: " + "; ".join(reasons) + ".")
