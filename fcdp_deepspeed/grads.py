"""Gradient reduction plan: hierarchical reduce-scatter and node-local gradient accumulation.

[Note: the two-stage reduction]
DeepSpeed's bucketed reduce-scatter (``reduce_scatter_coalesced``) gives DP-group rank g the sum,
over all W ranks, of chunk g (``P = ceil(numel / W)`` elements) of every gradient in the bucket,
pre-divided by W. With N nodes of L ranks, ``grad_reduce: hierarchical`` computes the same sum in two
stages:

- stage 1, inside the node: the rank at node position j receives the node's sum of the N chunks
  owned by its *node peers* (the ranks at position j on every node), i.e. N*P elements;
- stage 2, across nodes, among the N peers only: each peer receives the sum of its own chunk.

Each rank sends (N-1)*P elements per gradient over the uplink, a node (N-1)/N of the gradient: the
lower bound for exact data parallelism. The stage-1 input is DeepSpeed's chunks permuted into
``ReduceLayout.order`` (block j = the chunks of peer group j, in peer-group rank order), so both
stages are plain reduce-scatters over contiguous blocks. On gloo, whose reduce-scatter costs a full
all-reduce, each stage is an all-to-all plus a local sum in the accumulation dtype (fp32), which moves
only what each peer needs; on other backends (NCCL) it is ``reduce_scatter_tensor``. The result is
each rank's partition in DeepSpeed's layout, so the optimizer, clipping, overflow checks and
checkpoints see no difference except the summation order.

[Note: node accumulation]
With ``grad_accumulation: node``, a micro-step that is not the accumulation boundary runs stage 1 only
and adds the result into :class:`NodeGradBuffer` (N*P fp32 elements per trainable parameter: 1/L of
the trainable parameters per rank). At the boundary, each bucket adds its stage-1 result to the buffer
and runs stage 2 once; parameters that got no gradient in the boundary micro-step are flushed at the
end of that backward (``FCDPStage3.independent_gradient_partition_epilogue``). DeepSpeed's partitions
receive a parameter's window sum once (copy), or in parts when reentrant checkpointing splits the
backward (add), see :meth:`GradReducer.split_delivered`. Inter-node gradient bytes per optimizer step
no longer grow with the number of micro-steps. The buffer is empty at every step boundary, so an
overflow-skipped step, ``zero_grad`` or a checkpoint load discard nothing that was not already handed
to DeepSpeed (``zero_grad`` also drops a partly filled window, as DeepSpeed's ``micro_step_id = 0``
does). Readers of DeepSpeed's gradient partitions *between* micro-steps (``safe_get_local_grad``
before the boundary) see nothing of the window so far under node accumulation; at the boundary they
see the full sum.
"""
from __future__ import annotations

import math
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

import deepspeed.comm.comm as _comm_module
from fcdp_deepspeed import device, faults, memory
from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.plan import BufferFit, GradPlan, resolve_grad_plan
from fcdp_deepspeed.stats import EventCounters, fmt_bytes
from fcdp_deepspeed.topology import Topology, build_peer_group, group_ranks


@dataclass(frozen=True)
class ReduceLayout:
    """Where each DP rank's chunk travels in the two-stage reduction, as seen by one rank."""

    dp_size: int
    node_ranks: tuple[int, ...]
    """This rank's node ∩ DP group, ascending global ranks (index = node position)."""
    peer_ranks: tuple[int, ...]
    """This rank's node peers (same position on every node), ascending global ranks."""
    blocks: tuple[tuple[int, ...], ...]
    """``blocks[j][q]``: DP-group rank owning the chunk that peer-group rank q of peer group j reduces."""
    dp_rank: int

    @property
    def nodes(self) -> int:
        return len(self.peer_ranks)

    @property
    def per_node(self) -> int:
        return len(self.node_ranks)

    @property
    def order(self) -> tuple[int, ...]:
        """DP-group rank whose chunk fills each of the W slots of the stage-1 input."""
        return tuple(r for block in self.blocks for r in block)


def build_layout(dp_ranks: Sequence[int], node_of_rank: Mapping[int, str], me: int) -> ReduceLayout:
    """The layout of ``me``'s DP group; positions and peers match ``topology.derive_peer_groups``."""
    dp_index = {r: i for i, r in enumerate(dp_ranks)}
    by_node: dict[str, list[int]] = defaultdict(list)
    for r in sorted(dp_ranks):
        by_node[node_of_rank[r]].append(r)
    nodes = list(by_node.values())
    node_ranks = tuple(by_node[node_of_rank[me]])
    position = node_ranks.index(me)
    blocks = tuple(tuple(dp_index[r] for r in sorted(ranks[j] for ranks in nodes)) for j in range(len(node_ranks)))
    return ReduceLayout(dp_size=len(dp_ranks), node_ranks=node_ranks,
                        peer_ranks=tuple(sorted(ranks[position] for ranks in nodes)), blocks=blocks,
                        dp_rank=dp_index[me])


def chunk_numel(numel: int, world: int) -> int:
    """Elements of one rank's chunk, as ``reduce_scatter_coalesced`` cuts it."""
    return math.ceil(numel / world)


def own_chunk_numel(numel: int, world: int, dp_rank: int) -> int:
    """Real (unpadded) elements of ``dp_rank``'s chunk: the length DeepSpeed's reduce returns."""
    p = chunk_numel(numel, world)
    return max(0, min(p, numel - dp_rank * p))


def fitting_prefix(sizes: Sequence[int], budget: int) -> int:
    """How many of ``sizes``, taken in order, fit in ``budget`` (an order every rank shares)."""
    used = 0
    for count, size in enumerate(sizes):
        if used + size > budget:
            return count
        used += size
    return len(sizes)


def pack_chunks(tensors: Sequence[torch.Tensor], order: Sequence[int], world: int) -> torch.Tensor:
    """``[slot][tensor]`` buffer: slot s holds every tensor's chunk owned by DP rank ``order[s]``,
    zero-padded to ``chunk_numel``. Returns a (len(order), sum of chunk sizes) tensor."""
    sizes = [chunk_numel(t.numel(), world) for t in tensors]
    ref = tensors[0]
    out = torch.empty(len(order), sum(sizes), dtype=ref.dtype, device=ref.device)
    index = order_index(order, ref.device)
    offset = 0
    for t, p in zip(tensors, sizes):
        flat = t.reshape(-1)
        if flat.numel() != world * p:
            flat = torch.cat([flat, flat.new_zeros(world * p - flat.numel())])
        out[:, offset:offset + p] = flat.view(world, p).index_select(0, index)
        offset += p
    return out


_ORDER_INDEX: dict[tuple, torch.Tensor] = {}


def order_index(order: Sequence[int], where: torch.device) -> torch.Tensor:
    """The permutation of :func:`pack_chunks` as an index tensor on the accelerator (``where``, the gradients'
    device), built once per (layout, device).

    [Note: cached index] Building it per bucket is a pageable host-to-device copy on the reduce stream,
    which makes the backward thread wait for the previous bucket's reduction; built once (planning or
    first bucket) it is only read afterwards, on the same reduce stream."""
    key = (tuple(order), str(where))
    index = _ORDER_INDEX.get(key)
    if index is None:
        index = _ORDER_INDEX[key] = device.small_to_accel(list(order), torch.long)
    return index


@dataclass
class NodeGradBuffer:
    """The node-shard accumulation buffer of one rank: N*P fp32 elements per buffered parameter.

    ``dirty`` holds the ds_ids with a partial window sum; every rank of the DP group reduces the same
    parameters in the same micro-steps, so the set is identical on all of them.
    """

    flat: Optional[torch.Tensor] = None
    offsets: dict[int, tuple[int, int]] = field(default_factory=dict)  # ds_id -> (offset, numel)
    dirty: set[int] = field(default_factory=set)
    device: str = "host"

    def slot(self, ds_id: int) -> Optional[torch.Tensor]:
        where = self.offsets.get(ds_id)
        return None if where is None or self.flat is None else self.flat.narrow(0, where[0], where[1])

    def accumulate(self, ds_id: int, cols: torch.Tensor) -> None:
        """Add ``cols`` (accelerator, accumulation dtype) into the slot; a clean slot is overwritten.

        [Note: host buffer, device add] A host slot is never read by the host: its partial sum is copied to
        the accelerator (pinned, async), the add runs there, and the result is copied back (async) on the
        same stream, so the next micro-step's copy of the slot is ordered after it."""
        slot = self.slot(ds_id).view_as(cols)
        if self.device == "host":
            device.to_host(device.to_accel(slot) + cols if ds_id in self.dirty else cols, out=slot)
        elif ds_id in self.dirty:
            slot.add_(cols)
        else:
            slot.copy_(cols)
        self.dirty.add(ds_id)

    def take(self, ds_id: int, shape: tuple[int, int]) -> torch.Tensor:
        """The window sum on the accelerator (read it before the next :meth:`accumulate`); the slot is clean."""
        self.dirty.discard(ds_id)
        return device.to_accel(self.slot(ds_id).view(shape))

    @property
    def nbytes(self) -> int:
        return 0 if self.flat is None else self.flat.numel() * self.flat.element_size()


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
        self.node_group = node_group
        self.peer_group = peer_group
        self.accumulation_dtype = accumulation_dtype
        self.is_boundary = is_boundary
        #: Set by :func:`build_reducer` from the resolved plan.
        self.node_accumulation = False
        backend = _comm_module.cdb.get_backend(dp_group)
        #: gloo's reduce-scatter moves a full all-reduce: use all-to-all + local sum there.
        self.use_alltoall = str(backend).lower() == "gloo"
        self.dp_ranks = tuple(group_ranks(dp_group))
        self._handled: dict[int, bool] = {}
        self._params_by_id: dict[int, torch.nn.Parameter] = {}
        self.buffer = NodeGradBuffer()
        self.counters = GradCounters()
        self.unbuffered_bytes = 0
        self._window: set[int] = set()  # ds_ids delivered to DeepSpeed in the current window
        self._last_delivered: set[int] = set()
        self._lock = threading.Lock()
        self._trainable: list = []
        self._buffer_planned = False

    # -- budget ---------------------------------------------------------------------------------
    def _buffer_sizes(self, params: Sequence[torch.nn.Parameter]) -> tuple[list, list[int]]:
        params = sorted(params, key=lambda p: p.ds_id)
        return params, [self.layout.nodes * chunk_numel(p.ds_numel, self.layout.dp_size) for p in params]

    def measure_buffer(self, params: Sequence[torch.nn.Parameter]) -> BufferFit:
        """Collective over the DP group: what buffering every trainable parameter needs, against the
        smallest budget share of any rank (an agreed input of :func:`~fcdp_deepspeed.plan.resolve_grad_plan`)."""
        params, numels = self._buffer_sizes(params)
        self._trainable = params
        on_device = self.config.grad_buffer_device == "device"
        return BufferFit(need_bytes=sum(numels) * self.accumulation_dtype.itemsize,
                         budget_bytes=self._agree_min(self._budget_bytes(on_device)),
                         device="device" if on_device else "host")

    @property
    def buffer_planned(self) -> bool:
        return self._buffer_planned

    def plan_buffer(self, params: Optional[Sequence[torch.nn.Parameter]] = None) -> None:
        """Collective over the DP group: reserve buffer slots for a prefix (ds_id order) of the trainable
        parameters (default: those given to :meth:`measure_buffer`) that fits the budget on every rank;
        the rest accumulate per rank, with one warning. Runs once."""
        if not self.node_accumulation or self._buffer_planned:
            return
        self._buffer_planned = True
        params, numels = self._buffer_sizes(self._trainable if params is None else params)
        self._params_by_id = {p.ds_id: p for p in params}
        itemsize = self.accumulation_dtype.itemsize
        on_device = self.config.grad_buffer_device == "device"
        budget = self._budget_bytes(on_device)
        fits = self._agree_min(fitting_prefix([n * itemsize for n in numels], budget))
        flat = self._allocate(sum(numels[:fits]), on_device) if fits else None
        if fits and self._agree_min(1 if flat is not None else 0) == 0:
            flat, fits = None, 0
        if flat is not None:
            offset = 0
            for p, numel in zip(params[:fits], numels):
                self.buffer.offsets[p.ds_id] = (offset, numel)
                offset += numel
            self.buffer.flat = flat
            self.buffer.device = "device" if on_device else "host"
        self.unbuffered_bytes = sum(numels[fits:]) * itemsize
        if fits < len(params) and dist.get_rank() == 0:
            from deepspeed.utils import logger
            key = "fcdp.grad_buffer_budget" + (" (accelerator memory, grad_buffer_device = device)" if on_device else "")
            logger.warning(f"fcdp: the node gradient-accumulation buffer needs {fmt_bytes(sum(numels) * itemsize)} per "
                           f"rank but {fmt_bytes(budget)} is allowed (or allocation failed); {len(params) - fits} of "
                           f"{len(params)} trainable parameters ({fmt_bytes(self.unbuffered_bytes)}) are reduced across "
                           f"nodes on every micro-step instead. Raise {key} to buffer them.")

    def _budget_bytes(self, on_device: bool) -> int:
        """This rank's share: accelerator budget per rank, or the host budget per node (resolved against
        ``memory.host_limit`` less its margin) split over its ranks. A pinned buffer costs its power-of-two
        rounding, so the host share is the largest request whose pinned cost fits."""
        spec = self.config.grad_buffer_budget_spec
        if on_device:
            return spec.resolve(get_accelerator().available_memory(), auto_fraction=0.25)
        usable = memory.usable_host(memory.host_limit())
        share = min(spec.resolve(usable, auto_fraction=0.25), usable) // self.layout.per_node
        return memory.pinned_capacity(share, self.config.pin_memory and device.pins_host_memory())

    def _allocate(self, numel: int, on_device: bool) -> Optional[torch.Tensor]:
        """The buffer, allocated once (pinned on the host); ``None`` when allocation fails here."""
        try:
            faults.maybe_fail(f"alloc_gradbuf_{'device' if on_device else 'host'}")
            alloc = device.accel_empty if on_device else device.pin_empty if self.config.pin_memory else device.host_empty
            return alloc(numel, self.accumulation_dtype).zero_()
        except (RuntimeError, MemoryError, faults.InjectedFault):
            return None

    def _agree_min(self, value: int) -> int:
        t = device.small_to_accel([value], torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.dp_group)
        return int(device.small_to_host(t)[0])

    # -- collectives ----------------------------------------------------------------------------
    def handles(self, group: Any) -> bool:
        """Whether a bucket partitioned over ``group`` is this engine's DP group (other groups, e.g.
        expert-parallel ones, keep DeepSpeed's flat reduce-scatter)."""
        key = id(group)
        if key not in self._handled:
            self._handled[key] = group_ranks(group) == self.dp_ranks
        return self._handled[key]

    def _scatter_sum(self, inp: torch.Tensor, group: Any, parts: int) -> torch.Tensor:
        """Reduce-scatter of ``inp`` (``parts`` equal blocks) over ``group``; result in the accumulation dtype."""
        if self.use_alltoall:
            recv = torch.empty_like(inp)
            dist.all_to_all_single(recv, inp, group=group)
            rows = recv.view(parts, -1)
            total = rows[0].to(self.accumulation_dtype, copy=True)
            for row in rows[1:]:  # fixed order: group-rank order
                total.add_(row.to(self.accumulation_dtype))
            return total
        out = torch.empty(inp.numel() // parts, dtype=inp.dtype, device=inp.device)
        dist.reduce_scatter_tensor(out, inp, group=group)
        return out.to(self.accumulation_dtype)

    def _inter_node(self, node_sums: list[torch.Tensor], comm_dtype: torch.dtype) -> list[torch.Tensor]:
        """Stage 2 for several parameters: each ``(N, P_i)`` node sum -> this rank's ``P_i`` chunk sum."""
        sizes = [t.shape[1] for t in node_sums]
        inp = torch.cat(node_sums, dim=1).to(comm_dtype).contiguous()
        own = self._scatter_sum(inp.view(-1), self.peer_group, self.layout.nodes)
        return list(own.split(sizes))

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
        node_sum = self._scatter_sum(stage1.view(-1), self.node_group, layout.per_node).view(layout.nodes, -1)
        accumulate = self.node_accumulation and not self.is_boundary()
        results: list[Optional[torch.Tensor]] = [None] * len(params)
        deliver: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for i, (param, tensor) in enumerate(zip(params, tensors)):
            p = chunk_numel(tensor.numel(), world)
            cols = node_sum[:, offset:offset + p]
            offset += p
            slot = self.buffer.slot(param.ds_id) if self.node_accumulation else None
            if slot is not None and accumulate:
                self.buffer.accumulate(param.ds_id, cols)
                results[i] = cols.new_empty(0)
                continue
            if slot is not None and param.ds_id in self.buffer.dirty:
                cols = self.buffer.take(param.ds_id, (layout.nodes, p)) + cols
            deliver.append((i, cols))
        if deliver:
            for (i, _), own in zip(deliver, self._inter_node([c for _, c in deliver], comm_dtype)):
                results[i] = own.narrow(0, 0, own_chunk_numel(params[i].ds_numel, world, layout.dp_rank))
        with self._lock:
            self._last_delivered = {params[i].ds_id for i, _ in deliver}
        self.counters.bump(accumulated=len(params) - len(deliver), delivered=len(deliver))
        return results  # type: ignore[return-value]

    def flush(self, comm_dtype: torch.dtype, bucket_numel: int) -> Iterator[tuple[list, list[torch.Tensor]]]:
        """Stage 2 for every parameter whose window sum is still in the buffer (no gradient in the
        boundary micro-step). Yields ``(params, partitions)`` batches in ds_id order; each is delivered
        before the next is reduced."""
        world = self.layout.dp_size
        pending = sorted(self.buffer.dirty)
        by_id = self._params_by_id
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
            owns = self._inter_node(sums, comm_dtype)
            parts = [own.narrow(0, 0, own_chunk_numel(p.ds_numel, world, self.layout.dp_rank))
                     for p, own in zip(params, owns)]
            with self._lock:
                self._last_delivered = set(batch)
            self.counters.bump(delivered=len(batch), flushed=len(batch))
            yield params, parts
            batch, numel = [], 0

    # -- delivery into DeepSpeed's partitions ---------------------------------------------------
    def split_delivered(self, params: Sequence[torch.nn.Parameter]) -> tuple[list[int], list[int], list[int]]:
        """Indices of ``params`` whose partition DeepSpeed must overwrite (first delivery in this window),
        add to (delivered before in this window), or not touch (gradient went into the node buffer)."""
        with self._lock:
            delivered, self._last_delivered = self._last_delivered, set()
            copy, add, skip = [], [], []
            for i, p in enumerate(params):
                if p.ds_id not in delivered:
                    skip.append(i)
                elif p.ds_id in self._window:
                    add.append(i)
                else:
                    self._window.add(p.ds_id)
                    copy.append(i)
            return copy, add, skip

    def new_window(self, discard: bool) -> None:
        """A step started (or ``zero_grad``): the next delivery of every parameter overwrites.
        ``discard`` also drops partial window sums still in the buffer (``zero_grad`` mid-window)."""
        with self._lock:
            self._window.clear()
        if discard:
            self.buffer.dirty.clear()  # a clean slot is overwritten by its next accumulation

    # -- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        return {
            "grad_buffer_host_bytes": self.buffer.nbytes if self.buffer.device == "host" else 0,
            "grad_buffer_device_bytes": self.buffer.nbytes if self.buffer.device == "device" else 0,
            "grad_buffer_params": len(self.buffer.offsets),
            "grad_unbuffered_bytes": self.unbuffered_bytes,
            "grad_accumulated": c.accumulated,
            "grad_delivered": c.delivered,
            "grad_flushed": c.flushed,
        }


# -- the hook into DeepSpeed's reduce-scatter ---------------------------------------------------
_LOCAL = threading.local()


@contextmanager
def bucket(reducer: Optional[GradReducer], params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Route the next ``reduce_scatter_coalesced`` call on this thread to ``reducer`` for ``params``."""
    previous = getattr(_LOCAL, "active", None)
    _LOCAL.active = (reducer, list(params)) if reducer is not None else None
    try:
        yield
    finally:
        _LOCAL.active = previous


def make_dispatch(original: Any) -> Any:
    """A drop-in for ``reduce_scatter_coalesced`` (as imported by DeepSpeed's stage-3 module): buckets
    of an engine with a :class:`GradReducer` go to it, everything else to DeepSpeed's function."""

    def reduce_scatter_coalesced(tensors, group=None):
        active = getattr(_LOCAL, "active", None)
        if active is not None and active[0].handles(group):
            reducer, params = active
            return reducer.reduce(params, tensors)
        return original(tensors, group)

    reduce_scatter_coalesced.__wrapped__ = original  # type: ignore[attr-defined]
    reduce_scatter_coalesced._fcdp_dispatch = True  # type: ignore[attr-defined]
    return reduce_scatter_coalesced


def install_dispatch() -> None:
    """Route DeepSpeed's stage-3 reduce-scatter through :func:`make_dispatch` (idempotent). Only
    buckets inside a :func:`bucket` block of an engine with a reducer are affected."""
    import deepspeed.runtime.zero.stage3 as stage3_module
    if not getattr(stage3_module.reduce_scatter_coalesced, "_fcdp_dispatch", False):
        stage3_module.reduce_scatter_coalesced = make_dispatch(stage3_module.reduce_scatter_coalesced)


def uninstall_dispatch() -> None:
    import deepspeed.runtime.zero.stage3 as stage3_module
    fn = stage3_module.reduce_scatter_coalesced
    if getattr(fn, "_fcdp_dispatch", False):
        stage3_module.reduce_scatter_coalesced = fn.__wrapped__


def build_reducer(config: FCDPConfig, topo: Topology, dp_group: Any, trainable: Sequence[torch.nn.Parameter],
                  accumulation_dtype: torch.dtype, is_boundary: Any, accumulation_steps: int = 2,
                  path_blockers: Sequence[str] = (), accumulation_blockers: Sequence[str] = ()
                  ) -> tuple[GradPlan, Optional[GradReducer]]:
    """Collective over the world: the engine's resolved gradient plan (logged once by rank 0), and its
    reducer, or ``None`` for DeepSpeed's own path (flat, or one node / one rank per node, where both
    stages would be one). With one micro-step per optimizer step every micro-step is a boundary, so the
    node buffer is only measured here; :meth:`GradReducer.plan_buffer` allocates it at the first
    micro-step that is not a boundary (``FCDPStage3._plan_buffer_if_window_grew``)."""
    def resolve(fit: Optional[BufferFit] = None) -> GradPlan:
        return resolve_grad_plan(config.grad_reduce, config.grad_accumulation, topo.num_nodes, topo.ranks_per_node,
                                 accumulation_steps, path_blockers, accumulation_blockers, fit)

    plan = resolve()
    reducer = None
    if plan.active:
        peer_ranks, peer_group = build_peer_group(topo)
        layout = build_layout(topo.dp_ranks, dict(enumerate(topo.node_of_rank)), dist.get_rank())
        assert layout.peer_ranks == peer_ranks and layout.node_ranks == topo.node_ranks, (layout, peer_ranks, topo)
        reducer = GradReducer(config, layout, dp_group, topo.group, peer_group, accumulation_dtype, is_boundary)
        if config.grad_accumulation != "rank" and not accumulation_blockers:
            plan = resolve(reducer.measure_buffer(trainable))
        reducer.node_accumulation = plan.grad_accumulation == "node"
        if accumulation_steps > 1:
            reducer.plan_buffer()
        install_dispatch()
    if dist.get_rank() == 0:
        from deepspeed.utils import logger
        (logger.warning if plan.fell_back else logger.info)(plan.log_line())
    return plan, reducer
