"""Where each chunk travels in the two-stage reduction: the layout of one rank's DP group and the chunk math.

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
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from fcdp_deepspeed.machine import device


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


def pack_chunks(tensors: Sequence[torch.Tensor], order: Sequence[int], world: int,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[slot][tensor]`` buffer: slot s holds every tensor's chunk owned by DP rank ``order[s]``,
    zero-padded to ``chunk_numel``. Returns a (len(order), sum of chunk sizes) tensor: ``out`` (a buffer of that
    many elements, e.g. the workspace's) viewed so, or a new one. Written in place, with no temporary the size of
    a gradient: each tensor's whole chunks land in their slots with one ``index_copy_`` (a permutation: unique
    indices, deterministic), its last partial chunk and the chunks past its end are written separately."""
    sizes = [chunk_numel(t.numel(), world) for t in tensors]
    ref = tensors[0]
    if out is None:
        out = torch.empty(len(order), sum(sizes), dtype=ref.dtype, device=ref.device)
    else:
        out = out.view(len(order), sum(sizes))
    slots = order_index(order, ref.device)
    slot_of = slot_positions(tuple(order))
    offset = 0
    for t, p in zip(tensors, sizes):
        if p == 0:  # an empty gradient has no chunk
            continue
        flat = t.reshape(-1)
        cols = out[:, offset:offset + p]
        whole, rest = divmod(flat.numel(), p)
        if whole:
            cols.index_copy_(0, slots[:whole], flat[:whole * p].view(whole, p))
        if rest:
            cols[slot_of[whole], :rest].copy_(flat[whole * p:])
            cols[slot_of[whole], rest:].zero_()
        empty_from = whole + (1 if rest else 0)
        if empty_from < world:
            cols.index_fill_(0, slots[empty_from:], 0)
        offset += p
    return out


@functools.lru_cache(maxsize=None)
def slot_positions(order: tuple[int, ...]) -> tuple[int, ...]:
    """The inverse of ``order``: the slot of the stage-1 input that holds DP rank r's chunk (computed once per
    layout: :func:`pack_chunks` asks for it every bucket)."""
    slots = [0] * len(order)
    for s, r in enumerate(order):
        slots[r] = s
    return tuple(slots)


_ORDER_INDEX: dict[tuple, torch.Tensor] = {}


def order_index(order: Sequence[int], where: torch.device) -> torch.Tensor:
    """The slot of each DP rank's chunk in :func:`pack_chunks`'s output (:func:`slot_positions` of ``order``, the
    inverse of the permutation ``order``, what ``index_copy_`` takes), as an index tensor on the accelerator
    (``where``, the gradients' device), built once per (layout, device).

    [Note: cached index] Building it per bucket is a pageable host-to-device copy on the reduce stream,
    which makes the backward thread wait for the previous bucket's reduction; built once (planning or
    first bucket) it is only read afterwards, on the same reduce stream. Built on ``where`` itself: the cache
    key is that device, whatever the current device is when it is first built."""
    key = (tuple(order), str(where))
    index = _ORDER_INDEX.get(key)
    if index is None:
        index = _ORDER_INDEX[key] = device.small_to_accel(list(slot_positions(tuple(order))), torch.long, where)
    return index

