"""The reducer: the two-stage collectives in place of DeepSpeed's reduce-scatter, for buckets and flushes.

How the stages are laid out: [Note: the two-stage reduction] in ``layout.py``; what the node buffer holds:
[Note: node accumulation] in ``buffer.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.grads.buffer import BufferPlanner, NodeGradBuffer
from fcdp_deepspeed.grads.collectives import StageCollectives
from fcdp_deepspeed.grads.delivery import DeliveryLedger
from fcdp_deepspeed.grads.inflight import InterNodeQueue
from fcdp_deepspeed.grads.layout import ReduceLayout, pack_chunks
from fcdp_deepspeed.grads.plan import BufferFit
from fcdp_deepspeed.grads.staging import NodeStage, StagedDelivery
from fcdp_deepspeed.machine.topology import group_ranks
from fcdp_deepspeed.reporting.stats import EventCounters


@dataclass
class GradCounters(EventCounters):
    """Per-engine gradient-path events."""

    accumulated: int = 0
    """Parameter gradients added to the node buffer (micro-steps that crossed no node boundary)."""
    delivered: int = 0
    """Parameter gradients handed to DeepSpeed's partitions after the inter-node stage."""
    flushed: int = 0
    """Of those, delivered at the end of the boundary backward (no gradient in that micro-step)."""
    first_early: int = 0
    """Windows whose first bucket was reduced at a quarter of the bucket ([Note: the first bucket leaves early])."""
    at_once: int = 0
    """Buckets whose stage 2 was issued right after their own stage 1 ([Note: nothing across, nothing kept])."""


class GradReducer(StagedDelivery):
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
        #: Stages in flight ([Note: the inter-node stage runs behind the backward] in ``inflight.py``).
        self.node_stages = InterNodeQueue(1)
        self.queue = InterNodeQueue(config.grad_inflight_buckets)

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
        empty tensor for gradients that went into the node buffer instead (see :meth:`split_delivered`), and for
        every one while stages are left in flight (:meth:`advance` and :meth:`complete` take them on: [Note: the
        inter-node stage runs behind the backward] in ``inflight.py``).
        """
        layout, world = self.layout, self.layout.dp_size
        assert len(params) == len(tensors) and all(p.ds_numel == t.numel() for p, t in zip(params, tensors)), \
            "fcdp: bucket parameters and gradients do not line up"
        comm_dtype = tensors[0].dtype
        stage1 = pack_chunks(tensors, layout.order, world)
        stage1.div_(world)  # DeepSpeed pre-divides by the DP size in the same dtype
        accumulate = self.node_accumulation and not self.is_boundary()
        numels = [t.numel() for t in tensors]
        if not self.deferring:  # grad_inflight_buckets 0: both stages complete here
            return self.after_node_stage(params, numels, self.comm.node_stage(stage1), comm_dtype, accumulate)
        issued = self.comm.issue_node_stage(stage1)
        self.node_stages.add(NodeStage(list(params), numels, issued, accumulate, comm_dtype))
        self.delivery.delivered(())
        return [t.new_empty(0, dtype=self.accumulation_dtype) for t in tensors]

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
            "grad_inflight_max": self.queue.high_water,
            "grad_first_bucket_early": c.first_early,
            "grad_stage2_at_once": c.at_once,
            **(self.comm.compressor.stats() if self.comm.compressor is not None else {}),
        }
