"""Batched refill: small cache misses gathered together in one two-stage gather (``fcdp.miss_batch_bytes``).

[Note: why batch misses]
After an optimizer step every trainable parameter's cached slice is stale, so each one is a miss at its
first fetch: DeepSpeed fetches module by module, so a LoRA model with k adapted modules issues k small
inter-node gathers per step. Their payload is at the lower bound already, but each collective also
costs a fixed amount (gloo: ~290 B of protocol per ring message over the uplink, NCCL: a launch and a
round trip), which for rank-2 adapters was 8% on top of the payload. At the first miss, when every stale
cached parameter together is at most ``miss_batch_bytes`` (full size) and at most a quarter of all cached
parameters (a few parameters change, as in PEFT), FCDP gathers all of them at once
(:meth:`HierarchicalGather.issue`, one coalesced collective per stage and dtype) and partitions them
again right away: DeepSpeed's release path fills each slot (``NodeCache.on_partition``), so the current
fetch and every later fetch of those parameters are hits. Same bytes across nodes, one message.

What it costs: the full parameters of the batch are on the accelerator together for the time of the
gather (at most ``miss_batch_bytes``; a plain gather of one module holds that module's), at the first
fetch of the forward pass, when activation memory is lowest. A stale parameter that is not used in the
step is gathered anyway (bytes it would not have needed); ``miss_batch_bytes: 0`` turns batching off.
Full fine-tuning (and the first step, when every slot is empty) stays with per-module gathers: there
the stale set is the model, per-message costs are negligible next to the payload, and a module's
gather overlaps the previous module's compute.

[Note: agreement] The batch is every EMPTY entry with a slot whose parameter is partitioned
(NOT_AVAILABLE), in ``ds_id`` order. Entry states change only at the same logical points on every rank
(fills on release, invalidation at step boundaries and checkpoint events), so every rank builds the
same batch at the same fetch and issues the same collectives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from fcdp_deepspeed.reporting.stats import CacheCounters
from fcdp_deepspeed.runtime.gather import HierarchicalGather
from fcdp_deepspeed.storage.cache import EntryState, NodeCache
from fcdp_deepspeed.storage import freshness


def _full_bytes(param: torch.nn.Parameter) -> int:
    return param.ds_numel * param.ds_tensor.element_size()


@dataclass(eq=False)
class MissBatcher:
    """Refills every stale cached parameter at once when they are small together (see [Note: why batch
    misses])."""

    cache: NodeCache
    gather: HierarchicalGather
    counters: CacheCounters
    #: ``fcdp.miss_batch_bytes``: largest full size of a batch (0: off).
    max_bytes: int
    #: The cache generation last decided on: one decision per set of stale entries, at its first miss.
    _decided: int = -1

    def batch(self) -> list[torch.nn.Parameter]:
        """The stale cached parameters to refill now, in ``ds_id`` order ([] when batching does not apply).

        Decided once per cache generation (the first miss after entries were dropped), so a full
        fine-tuning step does not batch the tail of the model once the rest has been fetched, and a
        step's later misses cost no scan."""
        if self.max_bytes <= 0 or self.cache.generation == self._decided:
            return []
        self._decided = self.cache.generation
        return self.plan()

    def plan(self) -> list[torch.nn.Parameter]:
        """What :meth:`batch` would refill at the next miss of this cache generation (no decision taken; the
        run-ahead pushes exactly this batch at a step's end, ``runahead.py``)."""
        if self.max_bytes <= 0:
            return []
        entries = sorted((e for e in self.cache.entries.values() if e.slot is not None), key=lambda e: e.param.ds_id)
        cached = sum(_full_bytes(e.param) for e in entries)
        limit = min(self.max_bytes, cached // 4)  # a small part of the model changed, as in PEFT
        params, total = [], 0
        for entry in entries:
            param = entry.param
            if (entry.state is not EntryState.EMPTY or param.ds_numel == 0
                    or param.ds_status is not ZeroParamStatus.NOT_AVAILABLE
                    or getattr(param, "ds_active_sub_modules", None)):  # DeepSpeed refuses to free those
                continue
            total += _full_bytes(param)
            if total > limit:
                return []
            params.append(param)
        if len(params) < 2 or self.gather.unsupported(params, quantize=False):
            return []  # one parameter gathers alone anyway; unsupported ones take the ring one by one
        return params

    def refill(self) -> list[torch.nn.Parameter]:
        """Called at every miss (not quantized): at the first one of a cache generation, gather the batch
        (if any) and fill its slots (collective over the DP group; every rank decides the same, see [Note:
        agreement]). Returns the refilled parameters ([] when nothing was batched)."""
        params = self.batch()
        if not params:
            return []
        freshness.gathered(params)
        self.gather.issue(params).wait()  # AVAILABLE: param.data holds the full parameter
        for p in params:
            p.partition()  # DeepSpeed's release: the slot fills (NodeCache.on_partition), the full tensor is freed
        self.counters.bump(batched_refills=1, batched_params=len(params))
        return params
