"""The two stages' collectives: a reduce-scatter inside the node, then one among the node peers."""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from deepspeed import comm as dist

import deepspeed.comm.comm as _comm_module
from fcdp_deepspeed.grads.inflight import Inflight
from fcdp_deepspeed.grads.layout import ReduceLayout
from fcdp_deepspeed.reporting import timeline


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

    def _scatter_sum(self, inp: torch.Tensor, group: Any, parts: int) -> torch.Tensor:
        """Reduce-scatter of ``inp`` (``parts`` equal blocks) over ``group``; result in the accumulation dtype."""
        return self._issue_scatter_sum(inp, group, parts, async_op=False).complete()[0]

    def _issue_scatter_sum(self, inp: torch.Tensor, group: Any, parts: int, async_op: bool = True) -> Inflight:
        """:meth:`_scatter_sum` issued (``async_op``: not waited for; ``inp`` is held until it completes)."""
        if self.use_alltoall:
            recv = torch.empty_like(inp)
            work = dist.all_to_all_single(recv, inp, group=group, async_op=async_op)

            def total() -> list:
                rows = recv.view(parts, -1)
                out = rows[0].to(self.accumulation_dtype, copy=True)
                for row in rows[1:]:  # fixed order: group-rank order
                    out.add_(row.to(self.accumulation_dtype))
                return [out]
            return Inflight([work], total, (inp, recv))
        out = torch.empty(inp.numel() // parts, dtype=inp.dtype, device=inp.device)
        work = dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)
        return Inflight([work], lambda: [out.to(self.accumulation_dtype)], (inp, out))

    def node_stage(self, stage1: torch.Tensor) -> torch.Tensor:
        """Stage 1: the packed ``(W, ...)`` input -> the node's ``(N, ...)`` sums of this rank's peers' chunks."""
        with timeline.waiting(timeline.Phase.GRAD_NODE_STAGE):
            return self._scatter_sum(stage1.view(-1), self.node_group, self.layout.per_node).view(self.layout.nodes, -1)

    def issue_node_stage(self, stage1: torch.Tensor) -> Inflight:
        """:meth:`node_stage` issued, not waited for: its result is ``complete()[0]``, viewed ``(N, ...)``."""
        with timeline.waiting(timeline.Phase.GRAD_NODE_STAGE):
            return self._issue_scatter_sum(stage1.view(-1), self.node_group, self.layout.per_node)

    def across_nodes(self, node_sums: list[torch.Tensor], comm_dtype: torch.dtype, ds_ids: Sequence[int],
                     window_sums: bool = False) -> list[torch.Tensor]:
        """Stage 2 of the parameters ``ds_ids``, waited for at once: :meth:`issue_across_nodes`, completed."""
        inflight = self.issue_across_nodes(node_sums, comm_dtype, ds_ids, window_sums)
        with timeline.waiting(timeline.Phase.GRAD_INTER_NODE):
            return inflight.complete()

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
        return self.issue_inter_node(node_sums, comm_dtype, window_sums).complete()

    def issue_inter_node(self, node_sums: list[torch.Tensor], comm_dtype: torch.dtype,
                         window_sums: bool = False) -> Inflight:
        """Stage 2 for several parameters: each ``(N, P_i)`` node sum -> this rank's ``P_i`` chunk sum, at completion.
        ``window_sums``: some of them hold more than one micro-step ([Note: fp16 window sums])."""
        sizes = [t.shape[1] for t in node_sums]
        inp = torch.cat(node_sums, dim=1).to(self.wire_dtype(comm_dtype, window_sums)).contiguous()
        issued = self._issue_scatter_sum(inp.view(-1), self.peer_group, self.layout.nodes)
        return Inflight(issued.works, lambda: list(issued.finish()[0].split(sizes)), issued.buffers)
