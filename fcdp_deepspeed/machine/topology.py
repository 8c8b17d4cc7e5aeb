"""Node layout and the node-local process group.

The cache group is *node ∩ ZeRO data-parallel group*: with tensor or pipeline parallelism the DP
group is a strict subgroup of the world, and a node group that mixed TP peers would gather slices
of different tensors. The pure functions here (node id from an environment, groups from a layout)
are unit-tested without any process group; :func:`build_topology` runs the collectives.
"""
from __future__ import annotations

import os
import socket
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from deepspeed import comm as dist

from fcdp_deepspeed.config import ds_compat

#: Explicit node identity (any string), e.g. for simulations with several launchers on one host.
NODE_ID_ENV = "FCDP_NODE_ID"
#: Launcher variables that carry the node index, in priority order.
NODE_INDEX_VARS = ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID")
#: Launcher variables that carry the number of ranks on this node (used to cross-check L).
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                   "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


class TopologyError(ValueError):
    """The node layout cannot host FCDP (non-uniform nodes, L not dividing the DP size...)."""


@dataclass(frozen=True)
class NodeIdentity:
    """Which node this rank is on, and where that came from (for error messages)."""

    node_id: str
    source: str
    expected_local_size: Optional[int] = None


def node_identity_from_env(env: Mapping[str, str], rank: int, ranks_per_node: Optional[int],
                           hostname: Optional[str] = None) -> NodeIdentity:
    """Resolve this rank's node from the config override or the launcher environment.

    Order: ``fcdp.ranks_per_node`` (blocks of consecutive global ranks), ``FCDP_NODE_ID``,
    torchrun ``GROUP_RANK``, deepspeed launcher ``CROSS_RANK``, ``SLURM_NODEID``, hostname.
    """
    expected = None
    for var in LOCAL_SIZE_VARS:
        value = env.get(var, "")
        if value.isdigit() and int(value) > 0:
            expected = int(value)
            break
    if ranks_per_node is not None:
        return NodeIdentity(f"node{rank // ranks_per_node}", "fcdp.ranks_per_node", ranks_per_node)
    if env.get(NODE_ID_ENV):
        return NodeIdentity(env[NODE_ID_ENV], NODE_ID_ENV, expected)
    for var in NODE_INDEX_VARS:
        if env.get(var, "") != "":
            return NodeIdentity(f"node{env[var]}", var, expected)
    return NodeIdentity(hostname or socket.gethostname(), "hostname", expected)


def guess_node_map(env: Mapping[str, str], world: int,
                   ranks_per_node: Optional[int] = None) -> tuple[Optional[tuple[str, ...]], str]:
    """Every rank's node id without a collective, for counting a plain ZeRO-3 engine's traffic.

    ``ranks_per_node`` (the block's, even when disabled), else the launcher's local size, each read
    as blocks of consecutive global ranks (how torchrun and the deepspeed launcher number ranks).
    ``(None, reason)`` when neither is known or the size does not divide the world.
    Why no collective: a plain engine's creation must not gain one (FCDP engines discover the layout
    with ``discover_node_map``, which replaces a guess).
    """
    size, source = ranks_per_node, "fcdp.ranks_per_node"
    if size is None:
        for var in LOCAL_SIZE_VARS:
            value = env.get(var, "")
            if value.isdigit() and int(value) > 0:
                size, source = int(value), var
                break
    if size is None or world % size != 0:
        return None, "unknown (no launcher local size; call fcdp_deepspeed.enable_comm_counting())"
    return tuple(f"node{r // size}" for r in range(world)), f"{source} (consecutive ranks per node)"


def derive_node_groups(node_of_rank: Mapping[int, str], dp_groups: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    """Intersect every DP group with every node; check each DP group has a uniform L.

    Returns the sorted list of distinct node-local groups (ranks ascending), which is the order in
    which every rank must create them.
    """
    result: set[tuple[int, ...]] = set()
    for dp in dp_groups:
        by_node: dict[str, list[int]] = defaultdict(list)
        for r in dp:
            by_node[node_of_rank[r]].append(r)
        sizes = {node: len(ranks) for node, ranks in by_node.items()}
        if len(set(sizes.values())) != 1:
            raise TopologyError(
                f"non-uniform nodes: the data-parallel group {list(dp)} has {sizes} ranks per node. FCDP needs the "
                f"same number of DP ranks on every node. Fix: launch the same number of processes per node, or set "
                f"fcdp.ranks_per_node to simulate a uniform layout.")
        result.update(tuple(sorted(ranks)) for ranks in by_node.values())
    return sorted(result)


def derive_peer_groups(node_of_rank: Mapping[int, str], dp_groups: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    """Node peers of every DP group: the ranks with the same position (index in their ascending
    node ∩ DP group) on each node. A peer group holds one rank per node, so the inter-node stage of
    a hierarchical reduction runs over it. Sorted, the order in which every rank must create them."""
    result: set[tuple[int, ...]] = set()
    for dp in dp_groups:
        by_node: dict[str, list[int]] = defaultdict(list)
        for r in sorted(dp):
            by_node[node_of_rank[r]].append(r)
        for position in range(min(len(ranks) for ranks in by_node.values())):
            result.add(tuple(sorted(ranks[position] for ranks in by_node.values())))
    return sorted(result)


@dataclass
class Topology:
    """The node layout as seen by one rank of one DP group."""

    node_of_rank: tuple[str, ...]
    dp_ranks: tuple[int, ...]
    node_ranks: tuple[int, ...]
    source: str
    group: Any = field(repr=False, default=None)
    dp_groups: tuple[tuple[int, ...], ...] = ()
    """Every rank's DP group (all DP groups of the job)."""
    peer_ranks: tuple[int, ...] = ()
    """This rank's node peers (same position on every node of its DP group); () when the DP group lies on
    one node or has one rank per node (nothing to split in two stages)."""
    peer_group: Any = field(repr=False, default=None)

    @property
    def ranks_per_node(self) -> int:
        return len(self.node_ranks)

    @property
    def rank_in_node(self) -> int:
        return self.node_ranks.index(dist.get_rank())

    @property
    def dp_size(self) -> int:
        return len(self.dp_ranks)

    @property
    def num_nodes(self) -> int:
        return self.dp_size // self.ranks_per_node

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        return len({self.node_of_rank[r] for r in ranks}) > 1

    @property
    def dp_shapes(self) -> list[tuple[int, int]]:
        """(nodes, ranks per node) of every DP group of the job, each once, sorted: the same on every rank."""
        shapes = set()
        for dp in self.dp_groups:
            nodes = len({self.node_of_rank[r] for r in dp})
            shapes.add((nodes, len(dp) // nodes))
        return sorted(shapes)


#: ProcessGroups created by FCDP, by rank tuple. Every rank creates the same groups in the same
#: order, so a second engine over the same layout reuses them instead of creating new ones.
_GROUPS: dict[tuple[int, ...], Any] = {}


def group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of a deepspeed.comm group (None: the world).

    Not ``dist.get_all_ranks_from_group``: it probes ranks until an exception that torch 2.13 no
    longer raises, and never returns.
    """
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group=group)))


def discover_node_map(ranks_per_node: Optional[int] = None, dp_group: Any = None) -> tuple[tuple[str, ...], str, list]:
    """Collective: every rank's node id (indexed by global rank), the source used, and every rank's DP ranks."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    if ranks_per_node is not None and world % ranks_per_node != 0:
        raise TopologyError(f"fcdp.ranks_per_node = {ranks_per_node} does not divide the world size {world}. "
                            f"Fix: set ranks_per_node to a divisor of {world}, or remove it to detect the layout.")
    ident = node_identity_from_env(os.environ, rank, ranks_per_node)
    gathered: list = [None] * world
    ds_compat.all_gather_object(gathered, (rank, ident.node_id, ident.expected_local_size, group_ranks(dp_group),
                                           ident.source))
    node_of_rank = [""] * world
    for r, node_id, *_ in gathered:
        node_of_rank[r] = node_id
    counts: dict[str, int] = defaultdict(int)
    for node_id in node_of_rank:
        counts[node_id] += 1
    # each rank's own source, so every rank raises the same error or none (environments may differ per rank)
    for r, node_id, expected, _, source in gathered:
        if expected is not None and source in (*NODE_INDEX_VARS, "hostname") and counts[node_id] != expected:
            raise TopologyError(
                f"rank {r}: the launcher says {expected} ranks run on its node but {counts[node_id]} ranks report "
                f"node id {node_id!r} (from {source}). Fix: set {NODE_ID_ENV} per node or fcdp.ranks_per_node.")
    return tuple(node_of_rank), ident.source, [g[3] for g in gathered]


def splits_in_two(node_of_rank: Sequence[str], dp: Sequence[int]) -> bool:
    """Whether a (uniform) DP group has several nodes of several ranks: the only layout where a two-stage
    gather or reduction can run, so the only one that gets node-peer groups."""
    return 1 < len({node_of_rank[r] for r in dp}) < len(dp)


def build_topology(dp_group: Any = None, ranks_per_node: Optional[int] = None) -> Topology:
    """Collective over the world: derive node ∩ DP groups and the node-peer groups of every DP group, and
    create them on every rank.

    [Note: groups from the global layout] ``new_group`` is collective over the world, and torch names a
    group by a per-rank count of ``new_group`` calls, so every rank must create the same groups in the same
    order: a rank that skipped one hangs at the next group that spans both kinds of rank. What is created
    depends only on every DP group of the job (gathered here), never on this rank's mode resolution, which
    depends on its own DP group's shape (a pipeline stage spread over two nodes and one on a single node
    resolve differently): node groups, then peer groups, each sorted."""
    node_of_rank, source, all_dp = discover_node_map(ranks_per_node, dp_group)
    dp_ranks = group_ranks(dp_group)
    dp_groups = tuple(sorted(set(all_dp)))
    node_map = dict(enumerate(node_of_rank))
    groups = derive_node_groups(node_map, dp_groups)
    peers = derive_peer_groups(node_map, [dp for dp in dp_groups if splits_in_two(node_of_rank, dp)])
    _create_groups(groups)
    _create_groups(peers)
    rank = dist.get_rank()
    mine = next(g for g in groups if rank in g)
    my_peers = next((p for p in peers if rank in p), ())
    return Topology(node_of_rank=node_of_rank, dp_ranks=dp_ranks, node_ranks=mine, source=source, group=_GROUPS[mine],
                    dp_groups=dp_groups, peer_ranks=my_peers, peer_group=_GROUPS.get(my_peers))


def _create_groups(groups: Iterable[tuple[int, ...]]) -> None:
    for ranks in groups:  # same order on every rank: new_group is collective over the world
        if ranks not in _GROUPS:
            _GROUPS[ranks] = dist.new_group(list(ranks))
