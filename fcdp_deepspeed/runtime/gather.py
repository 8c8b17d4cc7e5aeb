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
  ``fcdp.param_compression``, ``runtime/compressed_gather.py``) runs on this stream too;
- the *waiting* stream (whichever is current when DeepSpeed's handle waits, the all-gather stream
  again under the coordinator): ``AllGatherCoalescedHandle.wait`` waits on stage 2's work (stream-only
  on NCCL, a host wait on gloo, as for DeepSpeed's own flat gather), so it is ordered after both
  stages, and records the partition views on the stream that reads them.

Why not wait for stage 1 on the issuing stream at issue time: that stream is the all-gather stream, which the
compute stream waits for at every fetch, so it would wait for stage 1 of every prefetched miss (and with blocking
waits, so would the host).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import (AllGatherCoalescedHandle, MultipleAllGatherHandles,
                                                         ZeroParamStatus)
from deepspeed.runtime.zero.utils import assert_ints_same_as_other_ranks
from deepspeed.utils import logger

from fcdp_deepspeed.config import FCDPConfig, ds_compat
from fcdp_deepspeed.grads import ReduceLayout, build_layout
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.machine.topology import Topology, group_ranks
from fcdp_deepspeed.reporting import timeline
from fcdp_deepspeed.runtime.compressed_gather import ParamCompression
from fcdp_deepspeed.runtime.runahead import RunAhead
from fcdp_deepspeed.runtime.sequencer import StageTwo
from fcdp_deepspeed.runtime.staged import StreamAhead, copy_partitions, stages_on_streams
from fcdp_deepspeed.storage import freshness


def units(params: Sequence[torch.nn.Parameter], owner: dict, per_module: bool = False) -> list[list]:
    """``params`` (``ds_id`` ascending) per owning module (``per_module``: in module order, ``owner``: ``ds_id`` ->
    module index), then per dtype: the units ``HierarchicalGather.split`` divides into gathers."""
    by_key: dict[tuple, list] = {}
    for p in sorted(params, key=lambda q: q.ds_id):
        by_key.setdefault((owner.get(p.ds_id, -1) if per_module else 0, str(p.ds_tensor.dtype)), []).append(p)
    return [by_key[key] for key in sorted(by_key)]


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
    #: Event after the last write of partitions outside the optimizer step (``staged.partitions_edited``).
    edited: Any = None
    #: ``fcdp.param_push_bytes``: stage 1 issued ahead at the step's end (``runahead.py``); ``None``: off.
    runahead: Optional[RunAhead] = None
    #: Without streams: the deferred stage 2s, issued in FIFO order at the waits (``sequencer.py``).
    queue: Optional[StageTwo] = None
    #: With streams and ``fcdp.param_runahead_streams``: the stage-1 stream and stashes (``staged.py``).
    staged: Optional[StreamAhead] = None
    #: ``ds_id`` -> index of the module that owns the parameter (:func:`module_order`), for per-module gathers.
    owner: dict = field(default_factory=dict)
    #: How stage 2 follows stage 1, chosen once here from the backend (:meth:`__post_init__`), never per gather.
    stages: Callable[[list, bool, Any], tuple[torch.Tensor, int, Any]] = field(init=False, repr=False)
    _same_group: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.stages = self._stages_queued if self.queue is not None else self._stages_on_streams

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

    def issue(self, params: Sequence[torch.nn.Parameter], safe_mode: bool = False, per_module: bool = False) -> Any:
        """Start the two-stage gather of ``params`` (all NOT_AVAILABLE misses of the engine's DP group); with
        ``per_module``, one gather per owning module ([Note: a coalesced prefetch, gathered per module])."""
        params = sorted(params, key=lambda p: p.ds_id)  # same order on every rank, as DeepSpeed
        if safe_mode:
            assert_ints_same_as_other_ranks([p.ds_id for p in params])
            assert_ints_same_as_other_ranks([p.ds_tensor.ds_numel for p in params])
        parts = [(self._issue_one(group, lossy, unit), group)
                 for unit in units(params, self.owner, per_module) for group, lossy in self.split(unit)]
        if per_module and len(parts) > 1:
            return PerModuleHandle(parts)
        return MultipleAllGatherHandles([handle for handle, _ in parts])

    def split(self, unit: list, count: bool = True) -> list[tuple[list, bool]]:
        """One unit's gathers with whether each is compressed, exact before compressed (agreed: [Note:
        references]); ``count`` false: the run-ahead's planning, which counts no exact gather."""
        exact, compressed = self.compression.split(unit, count) if self.compression else (unit, [])
        return [(group, lossy) for group, lossy in ((exact, False), (compressed, True)) if group]

    def issue_groups(self, params: Sequence[torch.nn.Parameter], per_module: bool = False,
                     count: bool = True) -> list[tuple[list, bool]]:
        """The gathers :meth:`issue` makes of ``params``, in order, with whether each is compressed (:func:`units`,
        :meth:`split`). The run-ahead pushes exactly these groups (``runahead.py``)."""
        return [part for unit in units(params, self.owner, per_module) for part in self.split(unit, count)]

    def buffers(self, params: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(flat, bundle, mine, part)`` for a gather of ``params``: the W*P buffer with this rank's partitions
        copied into its slot, its node-position bundle (stage 1's output) and its own slot (stage 1's input)."""
        layout, dtype = self.layout, params[0].ds_tensor.dtype
        part, nodes, own = sum(p.ds_tensor.ds_numel for p in params), layout.nodes, self.own_slot
        flat = device.accel_empty(part * layout.dp_size, dtype)
        mine = copy_partitions(params, flat.narrow(0, own * part, part), self.stepped, self.edited,
                               freshness.last_write())  # issuing stream
        return flat, flat.narrow(0, (own // nodes) * nodes * part, nodes * part), mine, part

    def _issue_one(self, params: list, lossy: bool = False, unit: Optional[list] = None) -> AllGatherCoalescedHandle:
        """One gather of ``params``, a part of ``unit`` (:meth:`split`; default: all of it)."""
        runahead = self.runahead
        pending = runahead.take(params, lossy) if runahead is not None else None  # its stage 1 issued (runahead.py)
        if runahead is not None:
            runahead.record(params, unit if unit is not None else params)
        for p in params:
            p.ds_status = ZeroParamStatus.INFLIGHT
        if self.compression is not None:
            self.compression.issued(params, lossy)
        flat, part, stage2 = self.stages(params, lossy, pending)
        partitions = [flat.narrow(0, self.slots[r] * part, part) for r in range(self.layout.dp_size)]
        return AllGatherCoalescedHandle(allgather_handle=stage2, params=params, partitions=partitions,
                                        world_size=self.layout.dp_size)

    def _stages_queued(self, params: list, lossy: bool, pending: Any) -> tuple[torch.Tensor, int, Any]:
        """No streams ([Note: stage 1 does not block the host] in ``sequencer.py``): stage 2 deferred to the queue,
        after the stage 1 the run-ahead issued (``pending``, ``runahead.py``) or one issued now. Returns ``(flat, part,
        what completes stage 2)``."""
        if pending is not None:
            stage2 = self.queue.add(pending.flat, pending.bundle, pending.work, pushed=True)
            return pending.flat, pending.part, stage2
        flat, bundle, mine, part = self.buffers(params)
        return flat, part, self.queue.add(flat, bundle, self.stage1(params, bundle, mine, part, lossy, async_op=True))

    def _stages_on_streams(self, params: list, lossy: bool, pending: Any) -> tuple[torch.Tensor, int, Any]:
        """Streams ([Note: streams]): both stages ordered on the streams; a stage 1 the run-ahead issued (``pending``)
        lands in a pinned stash ([Note: the run-ahead on streams] in ``staged.py``)."""
        if pending is not None:
            flat, stage2 = self.staged.stage2(pending.work)
            return flat, pending.part, stage2
        flat, bundle, mine, part = self.buffers(params)
        return flat, part, stages_on_streams(self, params, flat, bundle, mine, part, lossy)

    def ahead(self, params: list, lossy: bool) -> tuple[Optional[torch.Tensor], torch.Tensor, int, Any]:
        """Stage 1 issued ahead (``runahead.py``): ``(flat, bundle, part, what completes it)``; on streams the bundle
        is a pinned stash and there is no flat buffer yet ([Note: the run-ahead on streams] in ``staged.py``)."""
        if self.staged is not None:
            staged = self.staged.issue(params)
            return None, staged.stash, staged.part, staged
        flat, bundle, mine, part = self.buffers(params)
        return flat, bundle, part, self.stage1(params, bundle, mine, part, lossy, async_op=True)

    def stage1(self, params: list, bundle: torch.Tensor, mine: torch.Tensor, part: int, lossy: bool,
               async_op: bool) -> Any:
        """Stage 1 into ``bundle``: what completes it when asynchronous (a work, or with ``fcdp.param_compression``
        the :class:`~fcdp_deepspeed.runtime.compressed_gather.StageOne` that decodes or seeds at its ``wait``: [Note: the
        compressed stage 1 in flight]), else ``None`` (complete, or ordered by the stream)."""
        clock = self.queue.clock if self.queue is not None else None
        if self.compression is not None:
            stage = self.compression.start(params, bundle, mine, part, self.peer_group, lossy=lossy,
                                           async_op=async_op, clock=clock)
            if not async_op:
                stage.wait()  # the decode (or the seeding) follows on the gather stream
                return None
            timeline.in_flight(clock, timeline.IN_FLIGHT_STAGE1, stage.work)
            return stage
        work = dist.allgather_fn(bundle, mine, group=self.peer_group, async_op=async_op)
        if not async_op:
            return None
        timeline.in_flight(clock, timeline.IN_FLIGHT_STAGE1, work)
        return work


class PerModuleHandle:
    """[Note: a coalesced prefetch, gathered per module]
    DeepSpeed's prefetch takes the parameters of the next modules, up to ``stage3_prefetch_bucket_size`` elements,
    into one ``all_gather_coalesced`` call and registers its one handle for every parameter (``PPC:484,613``): with
    its default 5e7 a small model's whole forward is one fetch, and the first module waited for every module's
    transfer. FCDP issues such a fetch as one two-stage gather per owning module (in module order, so that the
    first module's crosses first), and this handle's ``wait`` completes only the parts DeepSpeed is waiting for:
    the coordinator adds the module it fetches to each parameter's ``ds_active_sub_modules`` just before waiting
    that parameter's handle (0.19.8 ``PPC:393-406``), so the parts with an in-flight parameter of an active module
    are the ones needed now; when none is (a release of everything, another caller), every part is waited.
    Waiting more is always correct; a parameter left in flight would fail DeepSpeed's own AVAILABLE assertion.
    The same per-module groups are what the run-ahead pushes, whatever the prefetch setting, so a push made after
    a window without prefetch is used by a window with it and the other way round."""

    def __init__(self, parts: list[tuple[Any, list]]) -> None:
        self.parts = parts

    def wait(self, handle_dependency: bool = True) -> None:
        left = [(h, ps) for h, ps in self.parts if not h.complete]
        needed = [(h, ps) for h, ps in left
                  if any(p.ds_status is ZeroParamStatus.INFLIGHT and p.ds_active_sub_modules for p in ps)]
        for handle, _ in needed or left:
            handle.wait(handle_dependency=handle_dependency)

    @property
    def complete(self) -> bool:
        return all(h.complete for h, _ in self.parts)


def module_order(module: torch.nn.Module) -> dict[int, int]:
    """``ds_id`` -> index (in ``module.modules()`` order, identical on every rank) of the first module that owns it."""
    out: dict[int, int] = {}
    for i, m in enumerate(module.modules()):
        for p in m.parameters(recurse=False):
            if hasattr(p, "ds_id"):
                out.setdefault(p.ds_id, i)
    return out


def build_gather(config: FCDPConfig, topo: Topology,
                 clock: Optional[timeline.PhaseClock] = None) -> Optional[HierarchicalGather]:
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
    stream = device.side_stream("gather")
    return HierarchicalGather(layout, tuple(topo.dp_ranks), topo.group, topo.peer_group, slot_of_rank(layout),
                              stream=stream, queue=StageTwo(topo.group, clock) if stream is None else None)
