"""Pure layout logic: node identity from launcher environments, node ∩ DP groups, placement."""
from __future__ import annotations

import pytest

from fcdp_deepspeed.cache import Placement
from fcdp_deepspeed.placement import SlotRequest, plan_placement
from fcdp_deepspeed.topology import TopologyError, derive_node_groups, node_identity_from_env


@pytest.mark.parametrize("env, expected_node, source", [
    ({"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "node1", "GROUP_RANK"),  # torchrun
    ({"CROSS_RANK": "3", "LOCAL_SIZE": "8"}, "node3", "CROSS_RANK"),  # deepspeed launcher
    ({"SLURM_NODEID": "0"}, "node0", "SLURM_NODEID"),
    ({"FCDP_NODE_ID": "rack2-a", "GROUP_RANK": "0"}, "rack2-a", "FCDP_NODE_ID"),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, "hostA", "hostname"),  # MPI: hostname + local size
])
def test_node_identity_from_launcher_env(env, expected_node, source):
    ident = node_identity_from_env(env, rank=5, ranks_per_node=None, hostname="hostA")
    assert (ident.node_id, ident.source) == (expected_node, source)


def test_ranks_per_node_override_wins():
    ident = node_identity_from_env({"GROUP_RANK": "0"}, rank=5, ranks_per_node=2)
    assert ident.node_id == "node2" and ident.source == "fcdp.ranks_per_node"


def test_local_size_is_kept_for_cross_checks():
    assert node_identity_from_env({"CROSS_RANK": "0", "LOCAL_SIZE": "8"}, 0, None).expected_local_size == 8
    assert node_identity_from_env({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 0, None, "h").expected_local_size == 4


def test_node_groups_whole_world():
    nodes = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert derive_node_groups(nodes, [(0, 1, 2, 3)]) == [(0, 1), (2, 3)]


def test_node_groups_intersect_dp_subgroups():
    # 8 ranks = 2 nodes x 4, TP=2 (TP peers adjacent): DP groups {0,2,4,6} and {1,3,5,7}.
    nodes = {r: "a" if r < 4 else "b" for r in range(8)}
    groups = derive_node_groups(nodes, [(0, 2, 4, 6), (1, 3, 5, 7)])
    assert groups == [(0, 2), (1, 3), (4, 6), (5, 7)]


def test_non_uniform_nodes_rejected():
    nodes = {0: "a", 1: "a", 2: "a", 3: "b"}
    with pytest.raises(TopologyError, match="non-uniform"):
        derive_node_groups(nodes, [(0, 1, 2, 3)])


def test_placement_prefers_frozen_and_respects_budgets():
    reqs = [SlotRequest(0, 100, frozen=False), SlotRequest(1, 100, frozen=True), SlotRequest(2, 100, frozen=True)]
    plan = plan_placement(reqs, "device", host_budget=100, device_budget=100)
    assert plan == {1: Placement.DEVICE, 2: Placement.HOST, 0: None}
    plan = plan_placement(reqs, "host", host_budget=250, device_budget=10**9)
    assert plan == {1: Placement.HOST, 2: Placement.HOST, 0: None}
    assert all(v is Placement.HOST for v in plan_placement(reqs, "auto", 10**9, 10**9).values())
