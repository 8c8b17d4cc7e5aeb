"""The reducer: the two-stage collectives in place of DeepSpeed's reduce-scatter, for buckets and flushes.

How the stages are laid out: [Note: the two-stage reduction] in ``layout.py``; what the node buffer holds:
[Note: node accumulation] in ``buffer.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.grads.collectives import StageCollectives
from fcdp_deepspeed.grads.buffer import BufferPlanner, NodeGradBuffer
from fcdp_deepspeed.grads.delivery import DeliveryLedger
from fcdp_deepspeed.grads.layout import ReduceLayout, chunk_numel, own_chunk_numel, pack_chunks
from fcdp_deepspeed.plan import BufferFit
from fcdp_deepspeed.stats import EventCounters
from fcdp_deepspeed.topology import group_ranks


@dataclass
class GradCounters(EventCounters):
    """Per-engine gradient-path events."""

    accumulated: int = 0
    """Parameter gradients added to the node buffer (micro-steps that crossed no node boundary)."""
    delivered: int = 0
    """Parameter gradients handed to DeepSpeed's partitions after the inter-node stage."""
    flushed: int = 0
    """Of those, delivered at the end of the boundary backward (no gradient in that micro-step)."""


class GradReducer:
    """One engine's gradient plan: replaces DeepSpeed's reduce-scatter for its buckets.

    Built by ``FCDPStage3`` when ``grad_reduce``/``grad_accumulation`` leave DeepSpeed's path. All
    decisions that pick a collective (accumulate or deliver, buffered or not) are identical on every
    rank of the DP group: they depend on the boundary flag, the config and agreed budgets only.
    """

    def __init__(self, config: FCDPConfig, layout: ReduceLayout, dp_group: Any, node_group: Any, peer_group: Any,
                 accumulation_dtype: torch.dtype, is_boundary: Any) -> None:
        self.config = config
        self.layout = layout
        self.dp_group = dp_group
        self.accumulation_dtype = accumulation_dtype
        self.is_boundary = is_boundary
        #: Set by :func:`~fcdp_deepspeed.grads.build_reducer` from the resolved plan.
        self.node_accumulation = False
        self.comm = StageCollectives(layout, dp_group, node_group, peer_group, accumulation_dtype)
        self.dp_ranks = tuple(group_ranks(dp_group))
        self._handled: dict[int, bool] = {}
        self.buffer = NodeGradBuffer()
        self.planner = BufferPlanner(config, layout, dp_group, accumulation_dtype, self.buffer)
        self.counters = GradCounters()
        self.delivery = DeliveryLedger()

    # -- the node buffer (buffer.py) -----------------------------------------------------------
    def measure_buffer(self, params: Sequence[torch.nn.Parameter]) -> BufferFit:
        """See :meth:`BufferPlanner.measure` (collective over the DP group)."""
        return self.planner.measure(params)

    @property
    def buffer_planned(self) -> bool:
        return self.planner.planned

    def plan_buffer(self, params: Optional[Sequence[torch.nn.Parameter]] = None) -> None:
        """See :meth:`BufferPlanner.plan` (collective over the DP group); only under node accumulation."""
        if self.node_accumulation:
            self.planner.plan(params)

    # -- which buckets ---------------------------------------------------------------------------
    def handles(self, group: Any) -> bool:
        """Whether a bucket partitioned over ``group`` is this engine's DP group (other groups, e.g.
        expert-parallel ones, keep DeepSpeed's flat reduce-scatter)."""
        key = id(group)
        if key not in self._handled:
            self._handled[key] = group_ranks(group) == self.dp_ranks
        return self._handled[key]

    # -- the bucket path ------------------------------------------------------------------------
    def reduce(self, params: Sequence[torch.nn.Parameter], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """In place of ``reduce_scatter_coalesced(tensors, dp_group)`` for one bucket of ``params``.

        Returns this rank's partition per tensor (DeepSpeed's lengths), in the accumulation dtype; an
        empty tensor for gradients that went into the node buffer instead (see :meth:`split_delivered`).
        """
        layout, world = self.layout, self.layout.dp_size
        assert len(params) == len(tensors) and all(p.ds_numel == t.numel() for p, t in zip(params, tensors)), \
            "fcdp: bucket parameters and gradients do not line up"
        comm_dtype = tensors[0].dtype
        stage1 = pack_chunks(tensors, layout.order, world)
        stage1.div_(world)  # DeepSpeed pre-divides by the DP size in the same dtype
        node_sum = self.comm.node_stage(stage1)
        accumulate = self.node_accumulation and not self.is_boundary()
        results: list[Optional[torch.Tensor]] = [None] * len(params)
        deliver: list[tuple[int, torch.Tensor]] = []
        buffered: list[tuple[int, torch.Tensor]] = []
        window = False  # some delivered sum holds earlier micro-steps of the window
        offset = 0
        for i, (param, tensor) in enumerate(zip(params, tensors)):
            p = chunk_numel(tensor.numel(), world)
            cols = node_sum[:, offset:offset + p]
            offset += p
            slot = self.buffer.slot(param.ds_id) if self.node_accumulation else None
            if slot is not None and accumulate:
                buffered.append((param.ds_id, cols))
                results[i] = cols.new_empty(0)
                continue
            if slot is not None and param.ds_id in self.buffer.dirty:
                cols = self.buffer.take(param.ds_id, (layout.nodes, p)) + cols
                window = True
            deliver.append((i, cols))
        if buffered:
            self.buffer.accumulate(buffered)
        if deliver:
            owns = self.comm.across_nodes([c for _, c in deliver], comm_dtype, [params[i].ds_id for i, _ in deliver],
                                          window_sums=window)
            for (i, _), own in zip(deliver, owns):
                results[i] = own.narrow(0, 0, own_chunk_numel(params[i].ds_numel, world, layout.dp_rank))
        self.delivery.delivered(params[i].ds_id for i, _ in deliver)
        self.counters.bump(accumulated=len(params) - len(deliver), delivered=len(deliver))
        return results  # type: ignore[return-value]

    def flush(self, comm_dtype: torch.dtype, bucket_numel: int) -> Iterator[tuple[list, list[torch.Tensor]]]:
        """Stage 2 for every parameter whose window sum is still in the buffer (no gradient in the
        boundary micro-step). Yields ``(params, partitions)`` batches in ds_id order; each is delivered
        before the next is reduced."""
        world = self.layout.dp_size
        pending = sorted(self.buffer.dirty)
        by_id = self.planner.params_by_id
        batch: list[int] = []
        numel = 0
        for k, ds_id in enumerate(pending):
            batch.append(ds_id)
            numel += self.buffer.offsets[ds_id][1]
            if numel < bucket_numel and k + 1 < len(pending):
                continue
            params = [by_id[i] for i in batch]
            # on the accelerator: a host slot handed to the inter-node collective fails on NCCL
            sums = [self.buffer.take(i, (self.layout.nodes, self.buffer.offsets[i][1] // self.layout.nodes))
                    for i in batch]
            owns = self.comm.across_nodes(sums, comm_dtype, batch, window_sums=True)
            parts = [own.narrow(0, 0, own_chunk_numel(p.ds_numel, world, self.layout.dp_rank))
                     for p, own in zip(params, owns)]
            self.delivery.delivered(batch)
            self.counters.bump(delivered=len(batch), flushed=len(batch))
            yield params, parts
            batch, numel = [], 0

    # -- delivery into DeepSpeed's partitions ---------------------------------------------------
    def split_delivered(self, params: Sequence[torch.nn.Parameter]) -> tuple[list[int], list[int], list[int]]:
        """Indices of ``params`` whose partition DeepSpeed must overwrite (first delivery in this window),
        add to (delivered before in this window), or not touch (gradient went into the node buffer)."""
        return self.delivery.split(params)

    def new_window(self, discard: bool) -> None:
        """A step started (or ``zero_grad``): the next delivery of every parameter overwrites.
        ``discard`` also drops partial window sums still in the buffer (``zero_grad`` mid-window)."""
        self.delivery.new_window()
        if discard:
            self.buffer.dirty.clear()  # a clean slot is overwritten by its next accumulation

    # -- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        return {
            "grad_buffer_host_bytes": self.buffer.placed_bytes("host"),
            "grad_buffer_device_bytes": self.buffer.placed_bytes("device"),
            "grad_buffer_params": len(self.buffer.offsets),
            "grad_unbuffered_bytes": self.planner.unbuffered_bytes,
            "grad_accumulated": c.accumulated,
            "grad_delivered": c.delivered,
            "grad_flushed": c.flushed,
            **(self.comm.compressor.stats() if self.comm.compressor is not None else {}),
        }
