"""The two stages' collectives: a reduce-scatter inside the node, then one among the node peers."""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from deepspeed import comm as dist

import deepspeed.comm.comm as _comm_module
from fcdp_deepspeed.grads.inflight import Inflight
from fcdp_deepspeed.grads.layout import ReduceLayout
from fcdp_deepspeed.grads.workspace import Lease, Role, StageWorkspace
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.reporting import timeline


class HostMemoryInStage(RuntimeError):
    """A stage was handed host memory: NCCL cannot send it, and a copy would wait on the host."""


class CompressedStage(Protocol):
    """A stage 2 that replaces the exact one where it can (``fcdp.grad_compression``: ``compressed.GradCompressor``)."""

    def inter_node(self, node_sums: Sequence[torch.Tensor], ds_ids: Sequence[int],
                   exact: Callable[[list], Inflight]) -> Inflight:
        """Stage 2 of ``ds_ids`` issued: compressed where it can, ``exact`` for the rest."""

    def stats(self) -> dict:
        """Its ``grad_*`` keys of ``get_stats``."""


class StageCollectives:
    """Stage 1 over the node group, stage 2 over the peer group (see [Note: the two-stage reduction] in
    ``layout.py``); results in the accumulation dtype, summed in a fixed order."""

    def __init__(self, layout: ReduceLayout, dp_group: Any, node_group: Any, peer_group: Any,
                 accumulation_dtype: torch.dtype) -> None:
        self.layout = layout
        self.node_group = node_group
        self.peer_group = peer_group
        self.accumulation_dtype = accumulation_dtype
        backend = _comm_module.cdb.get_backend(dp_group)
        #: Which collective both stages use, chosen once here: gloo's reduce-scatter moves a full all-reduce, so
        #: all-to-all + local sum there, ``reduce_scatter_tensor`` elsewhere. [Note: summation dtype] The all-to-all
        #: path sums in the accumulation dtype (fp32), in group-rank order; ``reduce_scatter_tensor`` sums in the
        #: input's dtype: NCCL (and gloo) add bf16 inputs in bf16, one rounding per addition, as ZeRO-3's own
        #: reduce-scatter does.
        self.use_alltoall = str(backend).lower() == "gloo"
        #: ``fcdp.grad_compression``'s stage 2 (``compressed.py``), set by ``attach_compressor`` when it is on.
        self.compressor: Optional[CompressedStage] = None
        #: What both stages send and receive ([Note: a fixed workspace per stage] in ``workspace.py``).
        self.workspace = StageWorkspace()

    def set_bucket(self, bucket_numel: int) -> None:
        """The reduce bucket's size in elements (``FCDPStage3._cap_reduce_bucket``): each workspace role's limit, twice
        what a full bucket asks of it with room for the padding of 64 gradients ([Note: a fixed workspace per
        stage])."""
        packed = bucket_numel + 64 * self.layout.dp_size
        node = packed // self.layout.per_node
        self.workspace.set_bucket({
            Role.PACK: 2 * packed,
            Role.NODE_RECV: 2 * (packed if self.use_alltoall else node),
            Role.PEER_SEND: 2 * node,
            Role.PEER_RECV: 2 * (node if self.use_alltoall else node // self.layout.nodes)})

    def _scatter_sum(self, inp: torch.Tensor, group: Any, parts: int, role: Role) -> torch.Tensor:
        """Reduce-scatter of ``inp`` (``parts`` equal blocks) over ``group``; result in the accumulation dtype."""
        return self._issue_scatter_sum(inp, group, parts, async_op=False, role=role).result()[0]

    def _issue_scatter_sum(self, inp: torch.Tensor, group: Any, parts: int, async_op: bool = True,
                           role: Role = Role.PEER_RECV, own_result: bool = True) -> Inflight:
        """:meth:`_scatter_sum` issued (``async_op``: not waited for; ``inp`` is held until it completes), receiving
        into a ``role`` buffer of the workspace.

        [Note: what leaves the workspace] The result is a tensor of its own (``own_result``) wherever it leaves the
        reducer (DeepSpeed's partitions: ``partition_grads`` reads them after the stage's buffers went back) or
        outlives its stage; only stage 1's node sums may be a view of the workspace (NCCL with the accumulation
        dtype on the wire): they are consumed (copied into stage 2's input or a device slot of the node buffer on
        the reduce stream, or read by the node buffer's stream for a host slot) before their stage's buffers go
        back, with that stream's event (``GradReducer.advance``; [Note: when a buffer may be reused])."""
        if self.use_alltoall:
            recv = self.workspace.take(role, inp.numel(), inp.dtype)
            work = dist.all_to_all_single(recv.tensor, inp, group=group, async_op=async_op)

            def total() -> list:
                rows = recv.tensor.view(parts, -1)
                out = rows[0].to(self.accumulation_dtype, copy=True)
                for row in rows[1:]:  # fixed order: group-rank order
                    out.add_(row.to(self.accumulation_dtype))
                return [out]
            return Inflight([work], total, (inp,), (recv,))
        out = self.workspace.take(role, inp.numel() // parts, inp.dtype)
        work = dist.reduce_scatter_tensor(out.tensor, inp, group=group, async_op=async_op)
        return Inflight([work], lambda: [out.tensor.to(self.accumulation_dtype, copy=own_result)], (inp,), (out,))

    def node_stage(self, stage1: torch.Tensor) -> torch.Tensor:
        """Stage 1: the packed ``(W, ...)`` input -> the node's ``(N, ...)`` sums of this rank's peers' chunks."""
        with timeline.waiting(timeline.Phase.GRAD_NODE_STAGE):
            return self._scatter_sum(stage1.view(-1), self.node_group, self.layout.per_node,
                                     Role.NODE_RECV).view(self.layout.nodes, -1)

    def issue_node_stage(self, stage1: Lease) -> Inflight:
        """:meth:`node_stage` issued, not waited for, holding the packed input ``stage1`` (a workspace buffer) until
        it completes: its result is ``complete()[0]``, viewed ``(N, ...)``, valid until ``release()``."""
        with timeline.waiting(timeline.Phase.GRAD_NODE_STAGE):
            issued = self._issue_scatter_sum(stage1.tensor.view(-1), self.node_group, self.layout.per_node,
                                             role=Role.NODE_RECV, own_result=False)
        issued.leases = (stage1,) + issued.leases
        return issued

    def across_nodes(self, node_sums: list[torch.Tensor], comm_dtype: torch.dtype, ds_ids: Sequence[int],
                     window_sums: bool = False) -> list[torch.Tensor]:
        """Stage 2 of the parameters ``ds_ids``, waited for at once: :meth:`issue_across_nodes`, completed."""
        inflight = self.issue_across_nodes(node_sums, comm_dtype, ds_ids, window_sums)
        with timeline.waiting(timeline.Phase.GRAD_INTER_NODE):
            return inflight.result()

    def issue_across_nodes(self, node_sums: list[torch.Tensor], comm_dtype: torch.dtype, ds_ids: Sequence[int],
                           window_sums: bool = False) -> Inflight:
        """Stage 2 of the parameters ``ds_ids`` issued, not waited for ([Note: the inter-node stage runs behind the
        backward] in ``inflight.py``): :meth:`issue_inter_node`, or quantized with error feedback where
        ``fcdp.grad_compression`` holds a residual for them ([Note: the compressed exchange]: it encodes the
        accumulation-dtype sums at issue and decodes at completion, so no fp16 cast of a window sum arises there)."""
        with timeline.waiting(timeline.Phase.GRAD_INTER_NODE):
            if self.compressor is None:
                return self.issue_inter_node(node_sums, comm_dtype, window_sums)
            exact = lambda sums: self.issue_inter_node(sums, comm_dtype, window_sums)  # noqa: E731
            return self.compressor.inter_node(node_sums, ds_ids, exact)

    def wire_dtype(self, comm_dtype: torch.dtype, window_sums: bool) -> torch.dtype:
        """The dtype stage 2 sends.

        [Note: fp16 window sums] ZeRO-3 reduces each micro-step in the communication dtype and adds it into
        its partitions in the accumulation dtype; gradients are pre-divided by W, so a micro-step's sum stays
        within the range of the ranks' fp16 gradients. A node's window sum of K micro-steps is up to K*L/W
        times that, so cast to fp16 it could overflow where ZeRO-3 accumulating in fp32 does not (a skipped
        step and a halved loss scale ZeRO-3 would not have). So window sums travel in the accumulation dtype
        when the communication dtype is fp16: twice that stage's bytes with fp32 accumulation, no change with
        fp16 accumulation (DeepSpeed's default for fp16: ZeRO-3 accumulates its partitions in fp16 too; measured,
        the same skipped steps). bf16 has fp32's exponent range and stays bf16."""
        return self.accumulation_dtype if window_sums and comm_dtype == torch.float16 else comm_dtype

    def inter_node(self, node_sums: list[torch.Tensor], comm_dtype: torch.dtype,
                   window_sums: bool = False) -> list[torch.Tensor]:
        """:meth:`issue_inter_node`, waited for at once."""
        return self.issue_inter_node(node_sums, comm_dtype, window_sums).result()

    def issue_inter_node(self, node_sums: list[torch.Tensor], comm_dtype: torch.dtype,
                         window_sums: bool = False) -> Inflight:
        """Stage 2 for several parameters: each ``(N, P_i)`` node sum -> this rank's ``P_i`` chunk sum, at completion.
        ``window_sums``: some of them hold more than one micro-step ([Note: fp16 window sums])."""
        if any(device.is_host(t) for t in node_sums):  # e.g. a node-buffer slot not moved for the flush
            raise HostMemoryInStage("fcdp: stage 2 was handed host memory; its node sums must be on the accelerator "
                                    "(the node buffer's take() moves them)")
        sizes = [t.shape[1] for t in node_sums]
        send = self.workspace.take(Role.PEER_SEND, self.layout.nodes * sum(sizes),
                                   self.wire_dtype(comm_dtype, window_sums))
        try:
            columns = send.tensor.view(self.layout.nodes, -1)
            offset = 0
            for t, size in zip(node_sums, sizes):  # torch.cat into the workspace, cast to the wire dtype on the way
                columns[:, offset:offset + size].copy_(t)
                offset += size
            issued = self._issue_scatter_sum(send.tensor, self.peer_group, self.layout.nodes)
        except BaseException:
            send.release()
            raise
        return Inflight(issued.works, lambda: list(issued.finish()[0].split(sizes)), issued.buffers,
                        (send,) + issued.leases)
