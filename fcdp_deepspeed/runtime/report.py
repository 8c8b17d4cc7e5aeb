"""Reporting: one engine's stats dictionary, and its periodic log line and monitor events."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.utils import logger

from fcdp_deepspeed.machine import comm_warmup
from fcdp_deepspeed.reporting.monitor import monitor_events
from fcdp_deepspeed.reporting.stats import CacheCounters, CommCounters, format_stats_line
from fcdp_deepspeed.reporting.timeline import PhaseClock
from fcdp_deepspeed.runtime.allocation import Allocation
from fcdp_deepspeed.runtime.attach import Attachment
from fcdp_deepspeed.runtime.promotion import Promotion
from fcdp_deepspeed.storage.cache import EntryState, Placement, SlotPool


def slot_bytes(cache: Any, placement: Placement) -> int:
    """Bytes of the slots of this rank's cached parameters in ``placement``, filled or not (what the cache
    holds after the first forward; ``held_bytes`` is what is valid now, 0 for trainable ones after a step)."""
    return sum(e.nbytes for e in cache.entries.values() if e.state is not EntryState.DISABLED and e.placement is placement)


def log_info(line: str) -> None:
    """``line`` at INFO through DeepSpeed's logger whenever that logger is at INFO or below.

    [Note: the logger's level, not its handler's] The documented switch is DeepSpeed's own,
    ``deepspeed.utils.logging.set_log_level_from_string("info")`` (or ``deepspeed.utils.logger.setLevel``).
    DeepSpeed 0.19 sets the level on the logger and its stdout handler; 0.16-0.18 set it on the logger only, so
    the handler, created at WARNING, drops every INFO record and the ``[fcdp]`` line never shows. Handing the
    record to the handlers directly (``Handler.handle`` skips the handler's level) makes the one switch work
    on every admitted release; DeepSpeed's own INFO lines are unchanged."""
    if not logger.isEnabledFor(logging.INFO):
        return
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, line, None, None, "log_info")
    if logger.handlers:
        for handler in logger.handlers:
            handler.handle(record)
    else:
        logger.handle(record)


@dataclass(eq=False)
class Report:
    """Reads every part of one engine's runtime; owns only where and how often it reports."""

    attachment: Attachment
    allocation: Allocation
    counters: CacheCounters
    comm: CommCounters
    #: Report every that many optimizer steps (0: never); ``fcdp.log_interval``, resolved.
    log_interval: int
    #: The engine's own monitor, when enabled (see ``monitor.py``).
    monitor: Optional[MonitorMaster]
    #: The stats of the last ``[fcdp]`` line: the line reports the interval since (see ``format_stats_line``).
    last_reported: dict = field(default_factory=dict)
    promotion: Optional[Promotion] = None
    #: More keys from other parts (``fcdp.param_compression``'s), merged into :meth:`stats`.
    extra: Optional[Callable[[], dict]] = None
    #: The engine's host seconds per phase (``timeline.py``), reported as ``timeline_*``.
    clock: Optional[PhaseClock] = None

    def due(self) -> bool:
        """Whether this step boundary reports (the same on every rank)."""
        return bool(self.log_interval) and self.counters.optimizer_steps % self.log_interval == 0

    def on_step_end(self) -> None:
        step = self.counters.optimizer_steps
        if self.due():
            stats = self.stats()
            if self.monitor is not None:
                self.monitor.write_events(monitor_events(stats, step))
            if dist.get_rank() == 0:
                log_info(format_stats_line(stats, self.last_reported))
            self.last_reported = stats

    def stats(self) -> dict:
        cache, topo, c = self.attachment.cache, self.attachment.topology, self.counters
        uncached = self.attachment.uncached
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
            "hierarchical_gathers": c.hierarchical_gathers,
            "batched_refills": c.batched_refills,
            "batched_params": c.batched_params,
            "verified_gathers": c.verified_gathers,
            "stale_refetched": c.stale_refetched,
            "param_gather_fallbacks": dict(c.gather_fallbacks),
            "h2d_async_copies": c.staged_copies,
            "h2d_async_bytes": c.staged_bytes,
            "optimizer_steps": c.optimizer_steps,
            "host_cache_bytes": cache.held_bytes(Placement.HOST),
            "device_cache_bytes": cache.held_bytes(Placement.DEVICE),
            "host_slot_bytes": slot_bytes(cache, Placement.HOST),
            "device_slot_bytes": slot_bytes(cache, Placement.DEVICE),
            "host_pool_bytes": host_pool.nbytes if host_pool else 0,
            "device_pool_bytes": device_pool.nbytes if device_pool else 0,
            "pinned_pool_bytes": host_pool.pinned_nbytes if host_pool else 0,
            "pool_allocations": sum(p.allocations for p in cache.pools.values() if p is not None),
            "host_pool_allocations": host_pool.allocations if host_pool else 0,
            "device_pool_allocations": device_pool.allocations if device_pool else 0,
            "cached_params": sum(1 for e in cache.entries.values() if e.state is not EntryState.DISABLED),
            "uncached_params": sum(uncached.values()) + sum(
                1 for e in cache.entries.values() if e.state is EntryState.DISABLED),
            "uncached_bytes": self.allocation.uncached_bytes,
            "uncached_reasons": dict(uncached),
            "ranks_per_node": topo.ranks_per_node,
            "num_nodes": topo.num_nodes,
            "node_ranks": list(topo.node_ranks),
            "peak_device_memory_bytes": get_accelerator().max_memory_allocated(),
            **self._memory_stats(host_pool),
        }
        out.update(self.comm.snapshot())
        out["param_compression"] = "off"
        if self.clock is not None:
            out.update(self.clock.stats())
        if self.extra is not None:
            out.update(self.extra())
        return out

    def _memory_stats(self, host_pool: Optional[SlotPool]) -> dict:
        """``memory``: pinning, the communicators' first use and the move to the accelerator (docs/gpu.md); one
        dict, so per-engine byte counters (``*_bytes`` at the top level) stay counters."""
        p = self.promotion
        return {"memory": {
            "host_pool_alloc_seconds": round(host_pool.alloc_seconds, 4) if host_pool else 0.0,
            "host_pool_retired_bytes": sum(c.numel() * c.element_size() for c, _ in host_pool.retired) if host_pool else 0,
            "comm_warmup_bytes": dict(comm_warmup.MEASURED),
            "comm_warmup_seconds": round(sum(comm_warmup.SECONDS), 4),
            "node_resident_bytes": self.allocation.node_rss,
            "device_headroom_bytes": p.headroom if p is not None else None,
            "device_budget_bytes": p.budget if p is not None else None,
        }}
