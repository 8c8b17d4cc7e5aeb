"""Two-stage parameter gather for cache misses (``fcdp.param_gather``): bit-identical to DeepSpeed's
flat ring on every path the cache runs on, (N-1)/N of each missed parameter per node uplink (counted
by the ledger), and a broken permutation fails."""
from __future__ import annotations

import pytest
import torch

from conftest import run_ranks

NODE = {"grad_accumulation": "node"}
SCENARIOS = [
    dict(name="large_ga1", steps=3),
    dict(name="large_node_ga4", fcdp=NODE, grad_accum=4, steps=2),
    # DeepSpeed's default prefetch/reuse keeps the small model gathered between forward and backward
    dict(name="default_regime_ga2", grad_accum=2, steps=2, regime="default", eval=True),
    dict(name="lora_ga2", grad_accum=2, steps=2, lora_rank=2, eval=True),
    dict(name="ckpt_zero_init_ga2", grad_accum=2, steps=2, ckpt=True, zero_init=True),
    dict(name="offload_param", steps=2, zero={"offload_optimizer": {"device": "cpu"},
                                            "offload_param": {"device": "cpu"}}),
    dict(name="device_cache_verify", steps=2, fcdp={"cache_device": "device", "verify": True}),
    # over budget: most parameters are DISABLED (uncached) and take the two-stage gather on every fetch
    dict(name="over_budget", steps=2, fcdp={"host_budget": 4096, "cache_device": "host"}),
]
SMALL = [SCENARIOS[0], SCENARIOS[1]]


def assert_bit_identical(run: dict, name: str) -> None:
    flat, hier = run["flat"], run["hierarchical"]
    assert hier.losses == flat.losses, (name, flat.losses, hier.losses)
    for key, w in flat.weights.items():
        assert torch.equal(w, hier.weights[key]), (name, key)
    if "eval" in flat.extra:
        assert torch.equal(flat.extra["eval"], hier.extra["eval"]), name
    assert flat.stats["param_gather"] == "flat" and flat.stats["hierarchical_gathers"] == 0
    assert hier.stats["param_gather"] == "hierarchical" and hier.stats["hierarchical_gathers"] > 0
    assert hier.stats["param_gather_fallbacks"] == {}
    if not hier.stats["verified_gathers"]:  # verify adds a flat reference gather per checked miss
        assert hier.stats["inter_node_allgather_bytes"] < flat.stats["inter_node_allgather_bytes"]


def test_config_key_and_auto_resolution():
    from fcdp_deepspeed.config import FCDPConfigError, parse_fcdp_config
    cfg = parse_fcdp_config({"fcdp": {"enabled": True}})
    assert cfg.param_gather == "auto" and cfg.resolved_param_gather(2, 2) == "hierarchical"
    assert cfg.resolved_param_gather(1, 8) == cfg.resolved_param_gather(4, 1) == "flat"  # degenerate layouts
    assert parse_fcdp_config({"fcdp": {"param_gather": "flat"}}).resolved_param_gather(2, 2) == "flat"
    assert parse_fcdp_config({"fcdp": {"param_gather": "hierarchical"}}).resolved_param_gather(1, 2) == "flat"
    with pytest.raises(FCDPConfigError, match="param_gather"):
        parse_fcdp_config({"fcdp": {"param_gather": "ring"}})


@pytest.fixture(scope="module")
def parity_2x2():
    return run_ranks("gather:parity", 4, timeout=1200, scenarios=SCENARIOS, ranks_per_node=2)


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_bit_identical_to_flat_2x2(parity_2x2, name):
    for per_rank in parity_2x2:
        assert_bit_identical(per_rank[name], name)


def test_verify_and_uncached_paths_are_exercised(parity_2x2):
    for per_rank in parity_2x2:
        assert per_rank["device_cache_verify"]["hierarchical"].stats["verified_gathers"] > 0
        over = per_rank["over_budget"]["hierarchical"].stats
        assert over["uncached_fetches"] > 0 and over["uncached_params"] > 0


def test_bit_identical_to_flat_2x4():
    for per_rank in run_ranks("gather:parity", 8, timeout=900, scenarios=SMALL, ranks_per_node=4):
        for sc in SMALL:
            assert_bit_identical(per_rank[sc["name"]], sc["name"])


@pytest.mark.parametrize("world, per_node", [(4, 2), (8, 4)])
def test_inter_node_bytes_per_miss_are_the_bound(world, per_node):
    """Each node receives (N-1)/N of a missed parameter over its uplink (ledger count, sum over its ranks)."""
    nodes = world // per_node
    for per_rank in run_ranks("gather:miss_bytes", world, timeout=600, ranks_per_node=per_node):
        for row in per_rank["rows"]:
            assert row["exact"], row
            assert row["node_inter_bytes"] * nodes == row["aligned_bytes"] * (nodes - 1), row


def test_flat_miss_bytes_are_the_ring():
    """The flat mode is DeepSpeed's ring: (W-1) partitions per rank, L (W-1)/W of the parameter per node."""
    for per_rank in run_ranks("gather:miss_bytes", 4, timeout=600, ranks_per_node=2, mode="flat"):
        for row in per_rank["rows"]:
            assert row["node_inter_bytes"] * 4 == row["aligned_bytes"] * 2 * 3, row


def test_broken_permutation_fails():
    """Partitions read back in slot order instead of DeepSpeed's rank order: values and training differ."""
    per_rank = run_ranks("gather:miss_bytes", 4, timeout=600, ranks_per_node=2, break_kind="no_permutation")
    assert not all(row["exact"] for row in per_rank[0]["rows"])
    per_rank = run_ranks("gather:parity", 4, timeout=600, scenarios=[SCENARIOS[0]], ranks_per_node=2,
                         break_kind="no_permutation")
    with pytest.raises(AssertionError):
        assert_bit_identical(per_rank[0]["large_ga1"], "large_ga1")


def test_verify_catches_a_broken_permutation():
    """``fcdp.verify`` compares every two-stage gather with the flat one and raises on a difference."""
    with pytest.raises(Exception, match="two-stage gathered value"):
        run_ranks("gather:parity", 4, timeout=600, scenarios=[dict(name="v", steps=1, fcdp={"verify": True})],
                  ranks_per_node=2, break_kind="no_permutation")


def test_batched_refill_of_small_misses():
    """LoRA: after the first step every stale adapter is refilled by one inter-node all-gather per step
    (one per adapted module without batching), with identical losses, weights and eval output."""
    for r in run_ranks("gather:batched", 4, timeout=600):
        on, off = r["batched"], r["unbatched"]
        assert on["losses"] == off["losses"] and torch.equal(on["eval"], off["eval"])
        for key, w in off["weights"].items():
            assert torch.equal(w, on["weights"][key]), key
        assert on["allgathers_per_step"] == [1, 1], on["allgathers_per_step"]
        assert min(off["allgathers_per_step"]) > 1, off["allgathers_per_step"]
        assert on["stats"]["batched_refills"] >= 2 and off["stats"]["batched_refills"] == 0


def test_the_run_ahead_pushes_the_batch_and_uses_it():
    """LoRA with ``param_push_bytes``: the step's end pushes the next window's batched refill as one group, and that
    refill uses it: still one inter-node all-gather per step, no push left unused, the same values."""
    for r in run_ranks("gather:batched", 4, timeout=600, runs=("pushed", "unbatched")):
        on, off = r["pushed"], r["unbatched"]
        assert on["losses"] == off["losses"] and torch.equal(on["eval"], off["eval"])
        for key, w in off["weights"].items():
            assert torch.equal(w, on["weights"][key]), key
        assert on["allgathers_per_step"] == [1, 1], on["allgathers_per_step"]
        s = on["stats"]
        assert s["param_push_used"] >= 2 and s["param_push_unused"] == 0 and s["batched_refills"] >= 2, s


def test_a_batch_that_skips_the_gather_fails():
    """Slots marked filled without gathering serve last step's adapters: verify raises."""
    with pytest.raises(Exception, match="differs from its plain ZeRO-3 gather"):
        run_ranks("gather:batched", 4, timeout=600, verify=True, break_kind="batch_skips_gather")


@pytest.mark.slow
def test_four_nodes_x_two_and_megatron_tp2():
    """4 nodes x 2 (8 ranks), and TP=2 with DP subgroups {0,2,4,6}/{1,3,5,7} on 2 nodes x 4."""
    for per_rank in run_ranks("gather:parity", 8, timeout=900, scenarios=[SCENARIOS[1]], ranks_per_node=2):
        assert_bit_identical(per_rank["large_node_ga4"], "4x2")
    for r in run_ranks("gather:megatron", 8, timeout=900):
        assert r["hierarchical"]["losses"] == r["flat"]["losses"] == r["plain"]["losses"]
        assert r["hierarchical"]["stats"]["hierarchical_gathers"] > 0
