"""``FCDPStage3``'s gradient part (a mixin of helpers; the DeepSpeed overrides that call them are ``FCDPStage3``'s,
in ``stage3.py``): DeepSpeed's bucket reduction goes to the engine's :class:`~fcdp_deepspeed.grads.GradReducer`,
``partition_grads`` applies the reducer's copy/add/skip decision, the inter-node stages in flight are delivered in FIFO
order ([Note: the inter-node stage runs behind the backward] in ``inflight.py``), and the end of the boundary backward
flushes the node buffer's window sums.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from deepspeed import comm as dist
from deepspeed.utils import logger

from fcdp_deepspeed.config import ds_compat
from fcdp_deepspeed.grads.dispatch import bucket
from fcdp_deepspeed.grads.inflight import Pending
from fcdp_deepspeed.grads.reducer import GradReducer
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.reporting import timeline
from fcdp_deepspeed.reporting.stats import GRAD_FAMILY, LEDGER, fmt_bytes

#: DeepSpeed's bucket reduction (private, name-mangled; pinned by the version gate).
AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
REDUCE_IPG = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
_BUCKET = timeline.Phase.GRAD_BUCKET  # a gradient bucket's (or the window flush's) host time (timeline.py)

#: [Note: bucket-sized work] DeepSpeed reduces a bucket when it is full (``reduce_bucket_size`` elements, default 5e8)
#: and the rest at the backward's end, so a model under 5e8 trainable elements is one bucket, reduced after its whole
#: backward: nothing is left to overlap its inter-node stage with. FCDP's engines therefore cap the bucket
#: (``fcdp.grad_bucket_size``) where the hierarchical reduce runs. ``auto`` splits the trainable elements into about
#: :data:`AUTO_BUCKETS` buckets, so all but the last one's inter-node stage can cross during the backward, and never
#: below :data:`MIN_AUTO_BUCKET` elements (1 MiB in fp32), where a collective's fixed cost would dominate; it never
#: raises DeepSpeed's value, and it stays at most 1/:data:`AUTO_SHARE_OF_DEEPSPEED` of it ([Note: the bucket pays for
#: the stages in flight]). Values do not change: every element is summed in
#: a fixed order that depends on the layout only (pre-divided, stage 1 over the node in group-rank order, stage 2 over
#: the node peers likewise; the node buffer adds micro-steps in order), whichever bucket it travels in; on NCCL the
#: order inside a reduce-scatter is NCCL's, as for any bucket. What changes is the number of collectives (one pair per
#: bucket) and, under ``grad_compression``, where the codec's blocks fall (a block never spans two buckets). The flat
#: path (``grad_reduce: flat``, one node, one rank per node) keeps DeepSpeed's buckets: gloo's reduce-scatter could sum
#: an element in another order in another buffer.
AUTO_BUCKETS = 8
MIN_AUTO_BUCKET = 2**18
#: [Note: the bucket pays for the stages in flight] DeepSpeed allocates its contiguous bucket buffer at
#: ``reduce_bucket_size`` elements; the hierarchical reduce holds more per bucket than ZeRO-3's flat one (the packed
#: stage-1 input, the node sums, the stage-2 buffers left in flight): about one bucket more at the peak with the
#: *same* bucket (the GPU check's case b, docs/gpu.md). At DeepSpeed's default size that is gigabytes of device
#: memory, a smaller maximum batch. So ``auto`` takes at most a third of DeepSpeed's size: the 2/3 of the buffer it
#: frees pays for the stages in flight. An explicit ``grad_bucket_size`` is taken as given.
AUTO_SHARE_OF_DEEPSPEED = 3


def bucket_cap(setting: object, trainable_numel: int, deepspeed_value: int) -> int:
    """The reduce bucket size an FCDP engine with the hierarchical reduce uses ([Note: bucket-sized work])."""
    if setting == 0:
        return deepspeed_value
    if setting == "auto":
        cap = max(MIN_AUTO_BUCKET, -(-trainable_numel // AUTO_BUCKETS))
        return min(deepspeed_value, cap, max(MIN_AUTO_BUCKET, deepspeed_value // AUTO_SHARE_OF_DEEPSPEED))
    return min(deepspeed_value, int(setting))


def _reduce_first_bucket_early(optimizer: Any, param: torch.nn.Parameter) -> None:
    """After each gradient enters DeepSpeed's bucket: reduce the window's first bucket once it is due ([Note: the first
    bucket leaves early] in ``grads/reducer.py``). Per gradient, so the bucket is looked up only while it is open."""
    reducer = optimizer.fcdp_grads
    if reducer is not None and reducer.first_bucket_open():
        comm_dtype, bucket = ds_compat.ipg_bucket(optimizer, param)
        if reducer.first_bucket_due(bucket, optimizer.reduce_bucket_size):
            getattr(optimizer, REDUCE_IPG)(comm_dtype)


class GradSteps:
    """The gradient path's part of ``FCDPStage3`` (see the module docstring): no DeepSpeed method is overridden here;
    ``super()`` in these helpers is the counting class, then DeepSpeed."""

    fcdp_grads: Optional[GradReducer]

    def _cap_reduce_bucket(self, setting: object, trainable: list) -> None:
        """Cap ``reduce_bucket_size`` where the reducer runs ([Note: bucket-sized work]); DeepSpeed's contiguous bucket
        buffers shrink with it (they were allocated at its value)."""
        if self.fcdp_grads is None:
            return
        cap = bucket_cap(setting, sum(p.ds_numel for p in trainable), int(self.reduce_bucket_size))
        self.fcdp_grads.comm.set_bucket(min(cap, int(self.reduce_bucket_size)))  # the stages' workspace limits
        if cap >= self.reduce_bucket_size:
            return
        self.reduce_bucket_size = cap
        shrunk = False
        for ipg in getattr(self, "ipg_buckets", {}).values():  # 0.19 (older releases keep a larger buffer)
            if getattr(ipg, "buffer", None) is not None and ipg.buffer.numel() > cap:
                ipg.buffer = torch.empty(cap, dtype=ipg.buffer.dtype, device=ipg.buffer.device)
                shrunk = True
        if shrunk:
            # [Note: the freed bucket stays reserved] The old buffer (2 GB in fp32 at DeepSpeed's default) goes back
            # to the caching allocator, not to the device: reserved memory that NCCL and other processes cannot use
            # (the GPU check's case b, docs/gpu.md). Once, at attach.
            device.empty_accel_cache()

    # CountedStage3 attributes and tags DeepSpeed's own epilogue and step; the deliveries and flushes below are FCDP's.
    def _grads_after_backward(self) -> None:
        """After DeepSpeed's ``independent_gradient_partition_epilogue``: the stages in flight delivered, and at the
        window's boundary the node buffer's sums."""
        if self.fcdp_grads is None:
            return
        self._deliver_inflight(keep=0)
        if ds_compat.is_boundary(self):
            self._flush_node_buffer()

    def _grads_drain_window(self) -> None:
        """Before the step: never step without the window's sums (unreachable when the engine drives the backward and
        the boundary)."""
        reducer = self.fcdp_grads
        if reducer is not None and (reducer.buffer.dirty or len(reducer.queue) or len(reducer.node_stages)):
            self._deliver_inflight(keep=0)
            self._flush_node_buffer()

    def _grads_after_gradient(self, param) -> None:
        """After a gradient entered DeepSpeed's bucket."""
        _reduce_first_bucket_early(self, param)

    def _grads_reduce_bucket(self, params_to_reduce, *args, **kwargs):
        """DeepSpeed's bucket reduction, its reduce-scatter the reducer's.
        [Note: DeepSpeed's own arguments pass through: see ds_compat.AVG_SCATTER_ARGS]"""
        self._plan_buffer_if_window_grew()
        with bucket(self.fcdp_grads, params_to_reduce):
            partitions = getattr(super(), AVG_SCATTER)(params_to_reduce, *args, **kwargs)
        reducer = self.fcdp_grads
        if reducer is not None and reducer.deferring:
            with self._timed(_BUCKET):  # on DeepSpeed's reduce stream (its caller's context)
                # the previous bucket's stage 1 (this one's too when nothing crosses yet: [Note: nothing across,
                # nothing kept] in grads/reducer.py): into the buffer or its stage 2 issued
                reducer.advance(keep=reducer.keep_after_bucket())
                for entry in reducer.queue.take(reducer.queue.depth):
                    self._deliver(entry)
        return partitions

    def _plan_buffer_if_window_grew(self) -> None:
        """The first bucket of the first window of more than one micro-step allocates the node buffer when
        build time saw one micro-step per window (Megatron sets the accumulation steps after initialize).
        Every rank reduces its first bucket together, so the agreement all-reduce is safe here; checked at
        the bucket rather than where the engine sets the boundary flag, which is a method call in 0.19 and
        an attribute write in 0.17/0.18 (``ds_compat.is_boundary``). A window already under way finishes
        per rank (its partitions hold micro-steps DeepSpeed added)."""
        reducer = self.fcdp_grads
        if (reducer is None or not reducer.node_accumulation or reducer.buffer_planned or self.micro_step_id != 0
                or ds_compat.is_boundary(self)):
            return
        with self._attributed(), LEDGER.tagged(None):  # the budget agreement is planning, not gradient traffic
            reducer.plan_buffer()
        if dist.get_rank() == 0:
            logger.info(f"fcdp: a window of more than one micro-step after initialize: node gradient-accumulation "
                        f"buffer allocated now ({fmt_bytes(reducer.buffer.nbytes)}/rank {reducer.buffer.device})")

    def _grads_partition(self, params_to_release, grad_partitions):
        """DeepSpeed's ``partition_grads`` with the reducer's copy/add/skip decision."""
        reducer = self.fcdp_grads
        if reducer is None or not (reducer.node_accumulation or reducer.deferring):
            return super().partition_grads(params_to_release, grad_partitions)
        copy, add, skip = reducer.split_delivered(params_to_release)
        # node accumulation: the ledger's window (a parameter's first delivery overwrites); per rank: DeepSpeed's own
        # rule (micro_step_id; a delivery completes in the backward that issued it, so it is that micro-step's)
        groups = ((copy, 0), (add, 1)) if reducer.node_accumulation else ((sorted(copy + add), self.micro_step_id),)
        buffers = []
        saved = self.micro_step_id
        try:
            for indices, step_id in groups:  # DeepSpeed copies at micro_step_id 0, else adds
                if indices:
                    self.micro_step_id = step_id
                    buffers += super().partition_grads([params_to_release[i] for i in indices],
                                                       [grad_partitions[i] for i in indices])
        finally:
            self.micro_step_id = saved
        for i in skip:  # in the node buffer or in flight: free the full gradient as DeepSpeed does after reducing it
            param = params_to_release[i]
            if param.grad is not None:
                device.record_stream(param.grad)
            param.grad = None
        return buffers

    def _deliver(self, entry: Pending) -> None:
        """Complete one stage 2 in flight and hand its partitions to DeepSpeed (``partition_grads``, by the ledger).
        __avg_scatter_grads rescales after its reduce-scatter only for gradient_predivide_factor != 1 (which
        DeepSpeed 0.16.9-0.19.8 refuse with reduce_scatter, the only path the reducer serves) and for expert-parallel
        groups (not the DP group, never reduced here): the partitions are final as they are."""
        self.partition_grads(entry.params, self.fcdp_grads.complete(entry))

    def _deliver_inflight(self, keep: int) -> None:
        """Complete every stage 1 in flight, then deliver the stages 2, oldest first, until at most ``keep`` are left."""
        reducer = self.fcdp_grads
        if len(reducer.queue) <= keep and not len(reducer.node_stages):
            return
        with self._reduce_stream_block():
            reducer.advance(keep=0)
            for entry in reducer.queue.take(keep):
                self._deliver(entry)

    def _flush_node_buffer(self) -> None:
        """Deliver window sums of parameters that got no gradient in the boundary micro-step."""
        reducer = self.fcdp_grads
        if not reducer.buffer.dirty:
            return
        with self._reduce_stream_block():
            for entry in reducer.flush(self.communication_data_type, self.reduce_bucket_size):
                reducer.queue.add(entry)
                for done in reducer.queue.take(reducer.queue.depth):
                    self._deliver(done)
            for done in reducer.queue.take(0):
                self._deliver(done)

    @contextmanager
    def _reduce_stream_block(self) -> Iterator[None]:
        """FCDP's deliveries after DeepSpeed's epilogue: on the reduce stream, attributed, timed.
        [Note: flush ordering] The step reads the partitions on the current stream: ordering it after the reduce stream
        suffices. With an offloaded optimizer the host reads the fp32 gradients that ``partition_grads`` copied
        asynchronously, so the host waits, as DeepSpeed's epilogue does."""
        stream = self.reduce_and_partition_stream
        with self._attributed(), LEDGER.tagged(GRAD_FAMILY), device.stream(stream), self._timed(_BUCKET):
            yield
        if self.offload_optimizer:
            device.host_wait_stream(stream)
        else:
            device.wait_stream(stream)
