"""Per-engine FCDP runtime: :class:`FCDPRuntime` attaches the node cache to one stage-3 engine.

The stage-3 hook (``engine/stage3.py``) holds one ``FCDPRuntime`` per engine and calls only its public
methods. Each concern is one module here, with the state it owns in one dataclass:

- ``attach.py`` (:class:`Attachment`: topology, cache entries, why the rest is uncached): which
  parameters are cached, and DeepSpeed's hpZ path pointed at the node group and our storage
  ([Note: how the cache plugs into DeepSpeed]);
- ``allocation.py`` (:class:`Allocation`: uncached bytes, auto-mode promotion done): budgets, the
  slots every rank agrees on, the move to the accelerator in ``auto`` mode;
- ``fetch.py`` (:class:`FetchPath`: verify rate, per-entry hit counts): the gather wrappers, hit/miss
  counting, verification, zero-size parameters ([Note: threads]);
- ``gather.py`` (:class:`HierarchicalGather`: peer/node groups, slot permutation): the two-stage
  all-gather of misses, ``fcdp.param_gather`` ([Note: the two-stage gather]);
- ``refill.py`` (:class:`MissBatcher`: the batch size cap): small stale parameters refilled together
  at the first miss, one collective instead of one per module ([Note: why batch misses]);
- ``compression.py``: ``fcdp.param_compression`` wired in (reference slots and their budget, [Note: which
  parameters are compressed]); the compressed stage 1 itself is ``runtime/compressed_gather.py``;
- ``invalidation.py`` (:class:`Invalidation`: optimizer-owned ids, ``keep_frozen``): which entries
  each value-changing event drops;
- ``report.py`` (:class:`Report`: cadence, monitor): ``stats()``, the log line and monitor events.

Entry states and slots belong to :class:`~fcdp_deepspeed.storage.cache.NodeCache`; counters to
:mod:`fcdp_deepspeed.reporting.stats`. The gradient path (hierarchical reduction, node-local accumulation) is
its own concern, :mod:`fcdp_deepspeed.grads`: it shares this runtime's topology and is routed from
``engine/stage3.py``'s reduction hooks (engines without an optimizer have no gradients).
"""
from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping, Optional

import torch

from deepspeed import comm as dist
from deepspeed.utils import logger

from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.machine import comm_warmup, device
from fcdp_deepspeed.paths import PathChoice, Paths
from fcdp_deepspeed.machine.topology import Topology
from fcdp_deepspeed.reporting.monitor import latest_monitor
from fcdp_deepspeed.reporting.stats import CacheCounters, CommCounters
from fcdp_deepspeed.reporting.timeline import PhaseClock
from fcdp_deepspeed.runtime.allocation import Allocation, offloaded_pageable, pageable_warning, warn_if_nothing_cached
from fcdp_deepspeed.runtime.attach import Attachment, attach
from fcdp_deepspeed.runtime.compressed_gather import ParamCompression
from fcdp_deepspeed.runtime.compression import build_compression
from fcdp_deepspeed.runtime.compression_reference import ReferenceCheckpoint
from fcdp_deepspeed.runtime.fetch import FetchPath, StaleCacheError
from fcdp_deepspeed.runtime.gather import build_gather, module_order
from fcdp_deepspeed.runtime.invalidation import Invalidation
from fcdp_deepspeed.runtime.promotion import Promotion
from fcdp_deepspeed.runtime.refill import MissBatcher
from fcdp_deepspeed.runtime.report import Report
from fcdp_deepspeed.runtime.runahead import RunAhead, build_runahead
from fcdp_deepspeed.runtime.staged import partitions_edited
from fcdp_deepspeed.storage.cache import NodeCache

__all__ = ["FCDPRuntime", "StaleCacheError"]


class FCDPRuntime:
    """Everything FCDP holds for one engine; built by :meth:`activate`, driven by ``stage3.py``."""

    def __init__(self, config: FCDPConfig, ds_config: Mapping[str, Any], module: torch.nn.Module, dp_group: Any,
                 optimizer_params: Iterable[torch.nn.Parameter], param_names: Optional[Mapping] = None,
                 comm: Optional[CommCounters] = None, clock: Optional[PhaseClock] = None, trains: bool = True,
                 paths: Optional[PathChoice] = None) -> None:
        self.config = config
        #: Why FCDP's paths run (``fcdp.link``; an engine on ZeRO-3's paths has no runtime: ``engine/stage3.py``).
        self.paths = paths if paths is not None else PathChoice(Paths.FCDP, "fcdp.link not consulted")
        self.ds_config = ds_config
        self.module = module
        self.dp_group = dp_group
        self.optimizer_ids = frozenset(p.ds_id for p in optimizer_params if hasattr(p, "ds_id"))
        self.param_names = dict(param_names or {})
        #: Whether the engine has an optimizer (a step's end): the run-ahead plans there.
        self.trains = trains
        self.log_interval = config.resolved_log_interval(ds_config.get("steps_per_print"))
        #: Shared by the parts: cache events (hits, fills, invalidations, steps) and this engine's collectives.
        self.counters = CacheCounters()
        self.comm = comm if comm is not None else CommCounters()
        #: Host seconds per phase of inter-node work (``timeline.py``), the engine's.
        self.clock = clock if clock is not None else PhaseClock()
        monitor = latest_monitor()  # the engine being built created it just before this optimizer
        self.monitor = monitor if monitor is not None and monitor.enabled else None
        # The parts, built by activate().
        self.attachment: Optional[Attachment] = None
        self.allocation: Optional[Allocation] = None
        self.promotion: Optional[Promotion] = None
        self.fetch: Optional[FetchPath] = None
        self.param_gather = "flat"
        self.invalidation: Optional[Invalidation] = None
        self.report: Optional[Report] = None
        #: ``fcdp.param_compression`` (``None``: off or not applicable) and its checkpoint part.
        self.compression: Optional[ParamCompression] = None
        self.compression_state: Optional[ReferenceCheckpoint] = None
        self.runahead: Optional[RunAhead] = None
        #: What this engine added to the model's partition hooks (removed again if its build fails).
        self._hook_listeners: list = []

    @property
    def topology(self) -> Optional[Topology]:
        return self.attachment.topology if self.attachment is not None else None

    @property
    def cache(self) -> Optional[NodeCache]:
        return self.attachment.cache if self.attachment is not None else None

    def activate(self) -> "FCDPRuntime":
        """Collective over the DP group: attach, allocate the agreed slots, wrap every gather. An engine whose build
        fails after attaching leaves nothing behind on the model's partition hooks (a retry, a second engine, finds
        the model as it was: [Note: two engines over one model] in ``attach.py``)."""
        params = [p for p in self.module.parameters() if hasattr(p, "ds_id")]
        self.attachment = attach(self.config, params, self.dp_group, self.param_names, self.counters)
        try:
            return self._build(params)
        except BaseException:
            self._detach()
            raise

    def _listen(self, listener) -> None:
        """``listener(param, has_been_updated)`` on every partition of the model (its ``zero.Init`` hooks)."""
        for hook in self.attachment.hooks:
            hook.listeners.append(listener)
        self._hook_listeners.append(listener)

    def _detach(self) -> None:
        for hook in self.attachment.hooks:
            if self.attachment.cache in hook.caches:
                hook.caches.remove(self.attachment.cache)
            hook.listeners[:] = [fn for fn in hook.listeners if fn not in self._hook_listeners]

    def _build(self, params: list) -> "FCDPRuntime":
        # this engine's collectives are classified by its own layout (stats.CommLedger.layout_for)
        self.comm.node_of_rank, self.comm.layout_source = tuple(self.topology.node_of_rank), self.topology.source
        cache, topo = self.attachment.cache, self.attachment.topology
        gather = build_gather(self.config, topo, self.clock)
        if topo.num_nodes > 1:  # before placement: NCCL's buffers exist when the cache is placed ([Note: why warm up])
            comm_warmup.warm_up({"node": topo.group, "node_peers": topo.peer_group if gather is not None else None})
        self.allocation = Allocation(self.config, self.dp_group, topo, cache)
        self.allocation.plan_and_allocate()
        self.allocation.log_pinning()
        self._warn_pageable_offload()
        self.promotion = Promotion(self.config, cache)
        warn_if_nothing_cached(self.attachment, self.allocation)
        self.param_gather = "flat" if gather is None else "hierarchical"
        if gather is not None:
            gather.owner = module_order(self.module)  # per-module gathers of a coalesced prefetch
        self.gather = gather
        self.compression, self.compression_state = build_compression(  # collective (slot agreement)
            self.config, self.topology, gather, cache, self.allocation, self.optimizer_ids, params, self.param_names)
        if self.compression is not None:
            gather.compression = self.compression
            self._listen(self.compression.store.on_partition)
        batcher = MissBatcher(cache, gather, self.counters, self.config.miss_batch_bytes) if gather is not None else None
        self.fetch = FetchPath(cache, self.counters, self.comm, self.config.verify_rate, gather=gather, batcher=batcher,
                               clock=self.clock)
        for param in params:
            self.fetch.wrap(param)
        self.invalidation = Invalidation(cache, self.optimizer_ids, self.config.keep_frozen)
        if gather is not None and device.current().has_streams():  # [Note: the optimizer's writes] (staged.py)
            self.invalidation.listeners.append(functools.partial(partitions_edited, gather))
            self._listen(lambda param, updated, g=gather: updated and partitions_edited(g))
        self.runahead = build_runahead(self.config, gather, batcher, trains=self.trains)
        if self.runahead is not None:  # every value-changing event cancels what it names (runahead.py)
            self.invalidation.listeners.append(self.runahead.cancel)
            self._listen(self.runahead.on_partition)
        self.report = Report(self.attachment, self.allocation, self.counters, self.comm, self.log_interval,
                             self.monitor, promotion=self.promotion, clock=self.clock)
        extras = [part.stats for part in (self.runahead, ) if part is not None]
        if self.compression is not None:
            extras.append(lambda: self.compression.stats(self.comm))
        if extras:
            self.report.extra = lambda: {k: v for extra in extras for k, v in extra().items()}
        return self

    # -- events (``stage3.py`` says which DeepSpeed event calls each) ---------------------------
    def invalidate_params(self, params: Iterable[torch.nn.Parameter], reason: str) -> int:
        return self.invalidation.params(params, reason)

    def invalidate_changed(self) -> None:
        self.invalidation.changed()

    def flush(self, reason: str) -> None:
        self.invalidation.flush(reason)

    def checkpoint_event(self, inside: bool) -> None:
        """Between ``checkpoint_event_prologue`` and ``_epilogue`` (see ``ReferenceStore.in_checkpoint_event``)."""
        if self.compression is not None:
            self.compression.store.in_checkpoint_event = inside

    def weights_rewritten(self, why: str) -> None:
        """Every trainable parameter may have a new value from outside the optimizer (a checkpoint load that is
        not ours, ``refresh_fp32_params``): the next gathers cross exactly."""
        if self.compression is not None:
            self.compression.store.drop_all(why)

    def _warn_pageable_offload(self) -> None:
        """One warning (rank 0): DeepSpeed's offloaded partitions are pageable (its ``pin_memory`` defaults to
        false), so every copy of them to the accelerator, FCDP's two-stage gather's included, is synchronous."""
        if offloaded_pageable(self.ds_config) and device.pins_host_memory() and self.cache.entries and \
                dist.get_rank() == 0:
            logger.warning(pageable_warning("zero_optimization.offload_param.pin_memory is false") +
                           " Set zero_optimization.offload_param.pin_memory: true for DeepSpeed's offloaded partitions.")

    def on_step_end(self) -> None:
        self.counters.bump(optimizer_steps=1)
        if self.gather is not None:  # [Note: the optimizer's writes] (runtime/staged.py)
            self.gather.stepped = device.record_event()
        if self.compression is not None:  # before the push plans: a refresh step's plan is exact (runahead.py)
            self.compression.store.on_step_end()
        if self.runahead is not None:
            self.runahead.push()  # after the step's invalidation: the next window's stage 1 starts now
        self.promotion.on_step_end()
        if self.compression is not None and self.report.due():
            self.compression.collect_drift(self.dp_group)  # collective, at the report cadence only
        self.report.on_step_end()

    def stats(self) -> dict:
        out = {**self.report.stats(), "param_gather": self.param_gather}
        if self.runahead is not None:  # every copy found stale at use, whichever kind ([Note: freshness by construction])
            out["stale_refetched"] += self.runahead.counters.stale
        return out
