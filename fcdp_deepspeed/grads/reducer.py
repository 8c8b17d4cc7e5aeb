"""The reducer: the two-stage collectives in place of DeepSpeed's reduce-scatter, for buckets and flushes, and the
stages after they are issued: a bucket's stage 1 completed into the node buffer or into its stage 2, stage 2 issued
and completed, the window flush; in FIFO order ([Note: the inter-node stage runs behind the backward] in
``inflight.py``).

How the stages are laid out: [Note: the two-stage reduction] in ``layout.py``; what the node buffer holds:
[Note: node accumulation] in ``buffer.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.grads.buffer import BufferPlanner, NodeGradBuffer
from fcdp_deepspeed.grads.collectives import StageCollectives
from fcdp_deepspeed.grads.delivery import DeliveryLedger
from fcdp_deepspeed.grads.inflight import Inflight, InterNodeQueue, Pending
from fcdp_deepspeed.grads.layout import ReduceLayout, chunk_numel, own_chunk_numel, pack_chunks
from fcdp_deepspeed.grads.plan import BufferFit
from fcdp_deepspeed.grads.workspace import Role
from fcdp_deepspeed.machine.topology import group_ranks
from fcdp_deepspeed.reporting import timeline
from fcdp_deepspeed.reporting.stats import EventCounters

#: The window's first bucket is reduced once it holds this fraction of the bucket ([Note: the first bucket leaves early]).
FIRST_BUCKET_SHARE = 4


@dataclass(eq=False)
class NodeStage:
    """A bucket whose stage 1 (inside the node) was issued: what its completion needs."""

    params: list
    numels: list
    inflight: Inflight
    #: Whether the bucket's micro-step was not the accumulation boundary (node accumulation: into the buffer).
    accumulate: bool
    comm_dtype: torch.dtype


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
        #: Whether the current micro-step is the accumulation boundary (DeepSpeed's flag, agreed on every rank).
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
        #: Stages in flight ([Note: the inter-node stage runs behind the backward] in ``inflight.py``): stage 1 (the
        #: newest bucket's, completed at the next bucket or the backward's end) and stage 2
        #: (``fcdp.grad_inflight_buckets``).
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

        [Note: one packed input] The previous bucket's stage 1 is completed (its node sums into the node buffer or
        its stage 2 issued) before this bucket is packed, so one packed input is alive at a time and the workspace
        holds one (``workspace.py``). Completing it here rather than after this bucket's stage 1 is issued costs
        nothing measurable: stage 1 stays inside the node and was issued a bucket of backward earlier; its stage 2
        now leaves before this bucket's stage 1 (the two use different groups, so each group's order is unchanged,
        and so are the values).
        """
        layout, world = self.layout, self.layout.dp_size
        assert len(params) == len(tensors) and all(p.ds_numel == t.numel() for p, t in zip(params, tensors)), \
            "fcdp: bucket parameters and gradients do not line up"
        comm_dtype = tensors[0].dtype
        if self.deferring:  # [Note: one packed input] the previous bucket's stage 1 completes before this one packs
            self.advance(keep=0)
        numels = [t.numel() for t in tensors]
        pack = self.comm.workspace.take(Role.PACK, world * sum(chunk_numel(n, world) for n in numels), comm_dtype)
        accumulate = self.node_accumulation and not self.is_boundary()
        try:
            stage1 = pack_chunks(tensors, layout.order, world, out=pack.tensor)
            stage1.div_(world)  # DeepSpeed pre-divides by the DP size in the same dtype
            if not self.deferring:  # grad_inflight_buckets 0: both stages complete here
                node_sum = self.comm.node_stage(stage1)
            else:
                issued = self.comm.issue_node_stage(pack)
        except BaseException:
            pack.release()
            raise
        if not self.deferring:
            pack.release()
            return self.after_node_stage(params, numels, node_sum, comm_dtype, accumulate)
        self.node_stages.add(NodeStage(list(params), numels, issued, accumulate, comm_dtype))
        self.delivery.delivered(())
        return [t.new_empty(0, dtype=self.accumulation_dtype) for t in tensors]

    # -- the stages after they are issued, in FIFO order ------------------------------------------
    @property
    def deferring(self) -> bool:
        """Whether stages are left in flight (``fcdp.grad_inflight_buckets`` > 0) and delivered by the queue."""
        return self.queue.depth > 0

    def first_bucket_open(self) -> bool:
        """Whether the window's first delivering bucket is still being filled ([Note: the first bucket leaves early]):
        stages deferred, none issued yet, and this micro-step's sums cross the nodes."""
        return self.deferring and not len(self.queue) and not len(self.node_stages) and \
            not (self.node_accumulation and not self.is_boundary())

    def first_bucket_due(self, bucket: Any, bucket_size: int) -> bool:
        """Whether DeepSpeed's ``bucket`` (``ds_compat.ipg_bucket``; ``None``: not known) should be reduced now.

        [Note: the first bucket leaves early] DeepSpeed reduces a bucket when the next gradient would overflow it, so
        the backward's first bucket waits for the compute of the gradients after it while nothing crosses the nodes:
        the forward's parameters have all arrived and no gradient is ready (measured: the busiest uplink idle ~40 ms
        of a ~1 s step here, emulated 2 x 2 at 100 Mbit/s). So the window's first delivering bucket is reduced as soon
        as it holds 1/:data:`FIRST_BUCKET_SHARE` of ``reduce_bucket_size`` (after the gradient that filled it, in the
        same hook: ``engine/grad_steps.py``), and its stage 2 is issued at once ([Note: nothing across, nothing
        kept]). Agreed: the decision depends on element counts, the queue's counts and the boundary flag only, the
        same on every rank; values do not change (a bucket boundary never changes a sum: [Note: bucket-sized work]).
        Not in a micro-step whose sums go into the node buffer (nothing crosses then), and not with DeepSpeed
        releases before 0.19 (``ds_compat.ipg_bucket``: their buckets keep DeepSpeed's rule)."""
        elements = bucket.elements if bucket is not None and bucket.params else 0
        if not self.first_bucket_open() or not elements or elements * FIRST_BUCKET_SHARE < bucket_size:
            return False
        self.counters.bump(first_early=1)
        return True

    def keep_after_bucket(self) -> int:
        """How many of the newest stage 1s a bucket leaves in flight ([Note: nothing across, nothing kept]).

        [Note: nothing across, nothing kept] A bucket's stage 1 normally completes at the next bucket, so its stage 2
        can only start one bucket later; while another stage 2 is in flight that costs nothing (the inter-node link is
        busy). With none in flight (the window's first delivering bucket: the forward's parameters have all arrived)
        the link would idle until the next bucket, so the bucket waits for its own stage 1 (inside the node: fast) and
        issues its stage 2 at once. Agreed on every rank: the queue's length changes only by counts (buckets, depth,
        the backward's end), never by timing; the collectives and their order on each group are unchanged, only the
        second bucket's stage 1 is issued after the first's stage 2. Buckets whose sums go into the node buffer (a
        micro-step before the boundary) issue no stage 2 and keep theirs in flight."""
        if len(self.queue) or not len(self.node_stages):
            return 1
        if self.node_stages.entries[-1].accumulate:
            return 1
        self.counters.bump(at_once=1)
        return 0

    def advance(self, keep: int) -> None:
        """Complete the issued stage 1 of every bucket but the newest ``keep``, oldest first: each goes into the
        node buffer or has its stage 2 issued (queued: :meth:`complete` delivers it)."""
        for entry in self.node_stages.take(keep):
            with timeline.waiting(timeline.Phase.GRAD_NODE_STAGE):
                node_sum = entry.inflight.complete()[0].view(self.layout.nodes, -1)
            try:  # the node sums may be a view of the workspace: consumed before its buffers go back; a host slot
                # of the node buffer reads them on the buffer's stream ([Note: when a buffer may be reused])
                self.after_node_stage(entry.params, entry.numels, node_sum, entry.comm_dtype, entry.accumulate)
            finally:
                entry.inflight.release(after=self.buffer.done)

    def after_node_stage(self, params: Sequence[torch.nn.Parameter], numels: Sequence[int], node_sum: torch.Tensor,
                         comm_dtype: torch.dtype, accumulate: bool) -> list[Optional[torch.Tensor]]:
        """A bucket's node sums ``(N, sum of P_i)``: into the node buffer (``accumulate``, buffered parameters), or
        stage 2. Returns the partitions when stage 2 completed at once (not :attr:`deferring`), else empty tensors
        (DeepSpeed skips them: the buffer or the queue delivers them)."""
        world, layout = self.layout.dp_size, self.layout
        results: list[Optional[torch.Tensor]] = [node_sum.new_empty(0, dtype=self.accumulation_dtype)] * len(params)
        deliver: list[tuple[int, torch.Tensor]] = []
        buffered: list[tuple[int, torch.Tensor]] = []
        window = False  # some delivered sum holds earlier micro-steps of the window
        offset = 0
        for i, (param, numel) in enumerate(zip(params, numels)):
            p = chunk_numel(numel, world)
            cols = node_sum[:, offset:offset + p]
            offset += p
            slot = self.buffer.slot(param.ds_id) if self.node_accumulation else None
            if slot is not None and accumulate:
                buffered.append((param.ds_id, cols))
                continue
            if slot is not None and param.ds_id in self.buffer.dirty:
                cols = self.buffer.take(param.ds_id, (layout.nodes, p)) + cols
                window = True
            deliver.append((i, cols))
        if buffered:
            self.buffer.accumulate(buffered)
        self.counters.bump(accumulated=len(params) - len(deliver))
        direct: list = []
        if deliver:
            entry = self.issue([params[i] for i, _ in deliver], [c for _, c in deliver], comm_dtype, window)
            if self.deferring:
                self.queue.add(entry)
            else:  # grad_inflight_buckets 0: completed at once, the partitions go back to DeepSpeed
                direct = entry.params
                for (i, _), part in zip(deliver, self.complete(entry)):
                    results[i] = part
        self.delivery.delivered(p.ds_id for p in direct)
        return results

    def issue(self, params: Sequence[torch.nn.Parameter], sums: list[torch.Tensor], comm_dtype: torch.dtype,
              window_sums: bool) -> Pending:
        """Stage 2 of ``params`` issued (their ``(N, P_i)`` node sums ``sums``)."""
        inflight = self.comm.issue_across_nodes(sums, comm_dtype, [p.ds_id for p in params], window_sums=window_sums)
        world, rank = self.layout.dp_size, self.layout.dp_rank
        return Pending(list(params), inflight, [own_chunk_numel(p.ds_numel, world, rank) for p in params])

    def complete(self, entry: Pending) -> list[torch.Tensor]:
        """Wait for ``entry``'s stage 2 (the host on gloo, the current stream on NCCL); its partitions, in DeepSpeed's
        lengths, recorded in the ledger as the next delivery."""
        with timeline.waiting(timeline.Phase.GRAD_INTER_NODE):
            owns = entry.inflight.result()  # the partitions are tensors of their own
        self.delivery.delivered(p.ds_id for p in entry.params)
        self.counters.bump(delivered=len(entry.params))
        return [own.narrow(0, 0, n) for own, n in zip(owns, entry.lengths)]

    def flush(self, comm_dtype: torch.dtype, bucket_numel: int) -> Iterator[Pending]:
        """Stage 2 for every parameter whose window sum is still in the buffer (no gradient in the
        boundary micro-step), issued in batches whose stage-2 input is about a bucket's (``bucket_numel`` / L
        elements of node sums, as a bucket of ``bucket_numel`` sends: the workspace's pools fit both) in ds_id
        order; yields each batch's :class:`Pending` (the caller queues or completes it before the next is issued)."""
        pending = sorted(self.buffer.dirty)
        by_id = self.planner.params_by_id
        batch: list[int] = []
        numel = 0
        per_batch = max(1, bucket_numel // self.layout.per_node)
        for k, ds_id in enumerate(pending):
            batch.append(ds_id)
            numel += self.buffer.offsets[ds_id][1]
            if numel < per_batch and k + 1 < len(pending):
                continue
            # on the accelerator: a host slot handed to the inter-node collective fails on NCCL
            sums = [self.buffer.take(i, (self.layout.nodes, self.buffer.offsets[i][1] // self.layout.nodes))
                    for i in batch]
            self.counters.bump(flushed=len(batch))
            yield self.issue([by_id[i] for i in batch], sums, comm_dtype, window_sums=True)
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
            "grad_inflight_max": self.queue.high_water,
            "grad_first_bucket_early": c.first_early,
            "grad_stage2_at_once": c.at_once,
            **self.comm.workspace.stats(),
            **(self.comm.compressor.stats() if self.comm.compressor is not None else {}),
        }
