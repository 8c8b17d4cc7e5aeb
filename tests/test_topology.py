"""Node layout: node identity from launcher environments, node ∩ DP groups, real launchers, bad
layouts, and a Megatron-style layout where ZeRO's DP group is a strict subgroup of the world."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import TESTS_DIR, run_ranks, worker_target
from fcdp_deepspeed.machine.topology import TopologyError, derive_node_groups, node_identity_from_env
from fcdp_lab.harness.launch import free_port


# -- pure layout logic -----------------------------------------------------------------------------
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


# -- real launchers (two torchrun agents = two nodes on one host) ----------------------------------
def test_two_torchrun_agents_give_the_node_layout():
    workdir = Path(tempfile.mkdtemp(prefix="fcdp-torchrun-"))
    (workdir / "kwargs.pkl").write_bytes(pickle.dumps({}))
    port = str(free_port())
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=TESTS_DIR, PYTHONWARNINGS="ignore::FutureWarning")
    agents = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(n),
                          "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port,
                          "-m", "fcdp_lab.harness._worker", worker_target("topology:launcher_parity"), str(workdir)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        for n in (0, 1)
    ]
    try:
        logs = [a.communicate(timeout=300)[0].decode(errors="replace") for a in agents]
        assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
        results = [pickle.loads((workdir / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
        shutil.rmtree(workdir, ignore_errors=True)
    for r, res in enumerate(results):
        assert res["env"]["GROUP_RANK"] == str(r // 2) and res["env"]["LOCAL_WORLD_SIZE"] == "2"
        stats = res["fcdp"].stats
        assert stats["node_ranks"] == ([0, 1] if r < 2 else [2, 3]) and stats["num_nodes"] == 2
        assert res["fcdp"].losses == res["plain"].losses
        assert stats["cache_hits"] > 0
        assert stats["inter_node_allgather_bytes"] < 0.6 * res["plain"].stats["inter_node_allgather_bytes"]
    plain_w, fcdp_w = results[0]["plain"].weights, results[0]["fcdp"].weights
    assert all(torch.equal(plain_w[k], fcdp_w[k]) for k in plain_w)


# -- bad layouts -----------------------------------------------------------------------------------
def test_ranks_per_node_not_dividing_the_world():
    for msg in run_ranks("topology:topology_error", 4, ranks_per_node=3):
        assert msg.startswith("TopologyError") and "fcdp.ranks_per_node = 3 does not divide the world size 4" in msg


def test_non_uniform_nodes(monkeypatch):
    from fcdp_lab.harness.launch import run_local
    from conftest import TESTS_DIR as tests_dir
    rank_env = {r: {"FCDP_NODE_ID": "a" if r < 3 else "b"} for r in range(4)}
    res = run_local(worker_target("topology:topology_error"), 4, {}, timeout=240, pythonpath=[tests_dir], rank_env=rank_env)
    for msg in res:
        assert msg.startswith("TopologyError") and "non-uniform nodes" in msg and "'a': 3" in msg


# -- Megatron-style DP subgroups -------------------------------------------------------------------
@pytest.mark.slow
def test_megatron_layout_tp2_on_2_nodes_x_4():
    res = run_ranks("topology:megatron_layout", 8, timeout=600)
    expected_node_groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3], 4: [4, 6], 5: [5, 7], 6: [4, 6], 7: [5, 7]}
    for rank, r in enumerate(res):
        assert r["fcdp"]["stats"]["node_ranks"] == expected_node_groups[rank]  # node ∩ DP, never TP peers
        assert r["fcdp"]["losses"] == r["plain"]["losses"]
        assert r["fcdp"]["stats"]["cache_hits"] > 0
    # The layout is a real trap: hpZ's contiguous blocks pair TP peers and training diverges.
    assert any(r["hpz"].get("losses") != r["plain"]["losses"] for r in res)
    # Gradient node peers are derived inside each DP group too: {0,4},{2,6} and {1,5},{3,7}.
    for r in res:
        node, plain = r["fcdp_node_ga2"], r["plain_ga2"]
        assert node["stats"]["grad_accumulated"] > 0 and node["stats"]["grad_delivered"] > 0
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(node["losses"], plain["losses"])), (node, plain)
        assert len(node["losses"]) == len(plain["losses"]) == 6


def test_plain_engine_layout_is_derived_without_a_collective():
    from fcdp_deepspeed.machine.topology import guess_node_map
    assert guess_node_map({}, 4, ranks_per_node=2) == (("node0", "node0", "node1", "node1"),
                                                       "fcdp.ranks_per_node (consecutive ranks per node)")
    nodes, source = guess_node_map({"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "4"}, 4)  # torchrun's first
    assert nodes == ("node0", "node0", "node1", "node1") and source.startswith("LOCAL_WORLD_SIZE")
    assert guess_node_map({"LOCAL_SIZE": "4"}, 8)[0] == ("node0", ) * 4 + ("node1", ) * 4
    for env, world in (({}, 4), ({"LOCAL_WORLD_SIZE": "3"}, 4)):  # unknown, or not dividing the world
        nodes, source = guess_node_map(env, world)
        assert nodes is None and "enable_comm_counting" in source
