"""Hierarchical all-gather of the parameters the node cache does not serve (``fcdp.param_gather``).

[Note: the two-stage gather]
DeepSpeed gathers a miss with one ring over all W = N*L data-parallel ranks: (W-1)/W of the
parameter crosses every node uplink. Here the same primary partitions (``ds_tensor``, p elements per
DP rank) travel in two stages (MiCS's hierarchical all-gather):

1. all-gather among the rank's node peers (one rank per node, same node position): each node
   receives (N-1)/N of the parameter over its uplink, the lower bound;
2. all-gather of the N-partition bundles inside the node: every rank holds all W partitions.

Both stages write in place into one flat buffer of W*P elements (P: the partitions of the coalesced
parameters, concatenated), laid out in *slot* order: slot ``l*N + n`` holds the partition of the
n-th rank of the peer group at node position l (``grads.ReduceLayout.order``, the layout the
gradient path already uses). The slot views, listed by DP rank, go to DeepSpeed's own
``AllGatherCoalescedHandle``: its ``wait`` concatenates the partitions in DP-rank order (partition r
= elements [r*p, (r+1)*p)) into ``param.data`` and moves INFLIGHT -> AVAILABLE exactly as after its
flat gather, so the release hook fills the cache slot as before. No buffer beyond DeepSpeed's own
flat one: the stage inputs are views of the output (in-place all-gathers, as DeepSpeed's flat path).

[Note: streams] Three streams take part (CUDA; on the CPU accelerator there are none and gloo runs
every collective on the host):

- the *issuing* stream (DeepSpeed's all-gather stream, current when the coordinator issues a fetch):
  allocates the flat buffer and copies this rank's partitions into it (host -> accelerator under
  ``offload_param``). Nothing else is queued on it, so it never waits for a collective at issue time;
- the engine's *gather* stream (``HierarchicalGather.stream``, one per engine, through the door): waits
  for the issuing stream (the partition copies), then runs stage 1 with ``async_op=False``, which NCCL
  (torch >= 2.8) enqueues on the current stream, so stage 1 is ordered before stage 2 by this stream
  alone (no ``Work.wait`` at issue time: with ``TORCH_NCCL_BLOCKING_WAIT=1`` that would be a host wait).
  Stage 2 is issued asynchronously from it, so it starts after stage 1. The flat buffer, allocated on
  the issuing stream, is ``record_stream``-ed here. Anything between the stages (the dequantization of
  ``fcdp.param_compression``, ``compress/params.py``) runs on this stream too;
- the *waiting* stream (whichever is current when DeepSpeed's handle waits, the all-gather stream
  again under the coordinator): ``AllGatherCoalescedHandle.wait`` waits on stage 2's work (stream-only
  on NCCL, a host wait on gloo, as for DeepSpeed's own flat gather), so it is ordered after both
  stages, and records the partition views on the stream that reads them.

Before, stage 1's ``work.wait()`` ran on the issuing stream at issue time: the all-gather stream, which
the compute stream waits for at every fetch, then waited for stage 1 of every prefetched miss, and
with blocking waits the host did (issue 26).
[Measured on gloo before the gather stream: deferring stage 2 into the handle's ``wait``, so the host
does not wait on stage 1 at issue time, changed nothing on the emulated 2x2 cluster (1.426 vs 1.419 s
per step, 100 Mbit/s, large release regime; 1.417 vs 1.436 s with DeepSpeed's default prefetch).]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import (AllGatherCoalescedHandle, MultipleAllGatherHandles,
                                                         ZeroParamStatus)
from deepspeed.runtime.zero.utils import assert_ints_same_as_other_ranks
from deepspeed.utils import logger

from fcdp_deepspeed import device, ds_compat
from fcdp_deepspeed.compress.params import ParamCompression
from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.grads import ReduceLayout, build_layout
from fcdp_deepspeed.runtime.runahead import RunAhead
from fcdp_deepspeed.topology import Topology, group_ranks


def slot_of_rank(layout: ReduceLayout) -> tuple[int, ...]:
    """``slots[r]``: the slot of the flat buffer that receives DP rank r's partition."""
    slots = [0] * layout.dp_size
    for slot, rank in enumerate(layout.order):
        slots[rank] = slot
    return tuple(slots)


@dataclass(eq=False)
class HierarchicalGather:
    """Gathers one engine's misses in two stages; built once per engine by :func:`build_gather`."""

    layout: ReduceLayout
    dp_ranks: tuple[int, ...]
    node_group: Any
    peer_group: Any
    #: Every DP rank's slot in the flat buffer (:func:`slot_of_rank`): the permutation back to DeepSpeed's layout.
    slots: tuple[int, ...]
    #: The engine's gather stream (see [Note: streams]); ``None`` without streams.
    stream: Any = None
    #: ``fcdp.param_compression``: the compressed stage 1 (``None``: off, every stage 1 is exact).
    compression: Optional[ParamCompression] = None
    #: Event after the last optimizer step, on the stream it ran on ([Note: the optimizer's writes]).
    stepped: Any = None
    #: ``fcdp.param_push_bytes``: stage 1 issued ahead at the step's end (``runahead.py``); ``None``: off.
    runahead: Optional[RunAhead] = None
    _same_group: dict = field(default_factory=dict, repr=False)

    @property
    def own_slot(self) -> int:
        """Where this rank's partition goes: its node position's bundle, at its index among the peers."""
        me = dist.get_rank()
        return self.layout.node_ranks.index(me) * self.layout.nodes + self.layout.peer_ranks.index(me)

    def _over_dp_group(self, group: Any) -> bool:
        if id(group) not in self._same_group:
            self._same_group[id(group)] = group_ranks(group) == self.dp_ranks
        return self._same_group[id(group)]

    def unsupported(self, params: Sequence[torch.nn.Parameter], quantize: bool) -> str:
        """Why these parameters must take DeepSpeed's flat path ("" when they need not)."""
        for p in params:
            if quantize or hasattr(p.ds_tensor, "ds_quant_scale"):
                return "quantized weights"
            if p.ds_secondary_tensor is not None:
                return "cache hit"  # not a miss: DeepSpeed's node-group path serves it
            if not self._over_dp_group(p.ds_process_group):
                return "partitioned over another process group"
            if ds_compat.autocast_comm_dtype(p) not in (None, p.ds_tensor.dtype):
                return "autocast communication dtype"
            if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
                return "not partitioned"  # DeepSpeed raises its own error for this
        return ""

    def issue(self, params: Sequence[torch.nn.Parameter], safe_mode: bool = False) -> MultipleAllGatherHandles:
        """Start the two-stage gather of ``params`` (all NOT_AVAILABLE misses of the engine's DP group)."""
        params = sorted(params, key=lambda p: p.ds_id)  # same order on every rank, as DeepSpeed
        if safe_mode:
            assert_ints_same_as_other_ranks([p.ds_id for p in params])
            assert_ints_same_as_other_ranks([p.ds_tensor.ds_numel for p in params])
        by_dtype: dict[torch.dtype, list] = {}
        for p in params:
            by_dtype.setdefault(p.ds_tensor.dtype, []).append(p)
        handles = []
        for dtype in sorted(by_dtype, key=str):
            # exact and compressed parameters are separate collectives, in this order (agreed: [Note: references])
            exact, compressed = self.compression.split(by_dtype[dtype]) if self.compression else (by_dtype[dtype], [])
            handles += [self._issue_one(group, lossy) for group, lossy in ((exact, False), (compressed, True)) if group]
        return MultipleAllGatherHandles(handles)

    def lossy(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param``'s last two-stage gather was compressed (verify compares exact values only)."""
        return self.compression is not None and self.compression.lossy(param)

    def buffers(self, params: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(flat, bundle, mine, part)`` for a gather of ``params``: the W*P buffer with this rank's partitions
        copied into its slot, its node-position bundle (stage 1's output) and its own slot (stage 1's input)."""
        layout, dtype = self.layout, params[0].ds_tensor.dtype
        part = sum(p.ds_tensor.ds_numel for p in params)
        nodes = layout.nodes
        flat = device.accel_empty(part * layout.dp_size, dtype)
        own = self.own_slot
        mine = flat.narrow(0, own * part, part)
        offset = 0
        # [Note: the optimizer's writes] The partitions were last written by the optimizer step on the step's
        # stream, which the issuing stream (DeepSpeed's all-gather stream) is not ordered after: in 0.19.8 only
        # the throughput timer's device synchronize (from step 2, when enabled) orders them. FCDP's copy waits.
        device.wait_event(self.stepped)
        for p in params:  # host-resident under offload_param: an async copy on the issuing stream
            device.to_accel(p.ds_tensor, out=mine.narrow(0, offset, p.ds_tensor.ds_numel))
            offset += p.ds_tensor.ds_numel
        bundle = flat.narrow(0, (own // nodes) * nodes * part, nodes * part)
        return flat, bundle, mine, part

    def _issue_one(self, params: list, lossy: bool = False) -> AllGatherCoalescedHandle:
        runahead = self.runahead if not lossy else None
        pending = runahead.take(params) if runahead is not None else None  # its stage 1 complete (runahead.py)
        if runahead is not None:
            runahead.record(params)
        for p in params:
            p.ds_status = ZeroParamStatus.INFLIGHT
        if pending is not None:
            flat, bundle, part = pending.flat, pending.bundle, pending.part
            stage2 = dist.allgather_fn(flat, bundle, group=self.node_group, async_op=True)
        else:
            flat, bundle, mine, part = self.buffers(params)
            issuing = device.current_stream()
            with device.stream(self.stream):  # [Note: streams]
                device.wait_stream(issuing)  # the partition copies above
                device.record_stream(flat)  # allocated on the issuing stream, written on this one
                if lossy:
                    self.compression.stage1(params, bundle, part, self.peer_group)
                else:
                    self._exact_stage1(params, bundle, mine, part)
                stage2 = dist.allgather_fn(flat, bundle, group=self.node_group, async_op=True)
        partitions = [flat.narrow(0, self.slots[r] * part, part) for r in range(self.layout.dp_size)]
        return AllGatherCoalescedHandle(allgather_handle=stage2, params=params, partitions=partitions,
                                        world_size=self.layout.dp_size)

    def _exact_stage1(self, params: list, bundle: torch.Tensor, mine: torch.Tensor, part: int) -> None:
        if self.compression is None:
            dist.allgather_fn(bundle, mine, group=self.peer_group, async_op=False)  # ordered by the stream
            return
        with self.compression.exact_stage():
            dist.allgather_fn(bundle, mine, group=self.peer_group, async_op=False)
        self.compression.seed(params, bundle, part)


def build_gather(config: FCDPConfig, topo: Topology) -> Optional[HierarchicalGather]:
    """The engine's miss gather, ``None`` for the flat ring; no collective (the topology created every
    group, [Note: groups from the global layout]). Logs the resolved mode once per engine (rank 0)."""
    mode = config.resolved_param_gather(topo.num_nodes, topo.ranks_per_node)
    if dist.get_rank() == 0:
        logger.info(f"fcdp: param_gather = {config.param_gather!r} -> {mode} ({topo.num_nodes} node(s) x "
                    f"{topo.ranks_per_node} rank(s) per node)")
    if mode == "flat":
        return None
    layout = build_layout(topo.dp_ranks, dict(enumerate(topo.node_of_rank)), dist.get_rank())
    assert layout.peer_ranks == topo.peer_ranks and layout.node_ranks == topo.node_ranks, (layout, topo)
    return HierarchicalGather(layout, tuple(topo.dp_ranks), topo.group, topo.peer_group, slot_of_rank(layout),
                              stream=device.side_stream("gather"))
