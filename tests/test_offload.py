"""ZeRO-Offload with FCDP: ``offload_optimizer: cpu``, ``offload_param: cpu`` and both, in the large
release regime, fp32 and bf16, on 4 gloo ranks as 2 nodes x 2. Losses and weights bit-identical to
plain ZeRO-3 with the same offload settings, and the inter-node all-gather saving of the core
parity tests. One process group runs every scenario (module-scoped fixture)."""
from __future__ import annotations

import pytest

from conftest import run_ranks
from test_parity import assert_weights_bit_identical, step_deltas

OFFLOADS = {
    "optimizer": {"offload_optimizer": {"device": "cpu"}},
    "param": {"offload_param": {"device": "cpu"}},
    "both": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}
SCENARIOS = [dict(name=f"{what}_{dtype}", dtype=dtype, zero=zero, steps=3)
             for what, zero in OFFLOADS.items() for dtype in ("fp32", "bf16")]
NAMES = [s["name"] for s in SCENARIOS]


@pytest.fixture(scope="module")
def results():
    return run_ranks("parity:parity", 4, timeout=900, scenarios=SCENARIOS)


@pytest.mark.parametrize("name", NAMES)
def test_offload_losses_and_weights_bit_identical(results, name):
    for rank_result in results:
        plain, fcdp = rank_result[name]["plain"], rank_result[name]["fcdp"]
        assert fcdp.extra["optimizer_class"] == "FCDPStage3" and plain.extra["optimizer_class"] == "CountedStage3"
        assert fcdp.losses == plain.losses, (plain.losses, fcdp.losses)
        stats = fcdp.stats
        assert stats["cache_hits"] > 0 and stats["uncached_params"] == 0, stats
    assert_weights_bit_identical(results[0][name])


@pytest.mark.parametrize("name", NAMES)
def test_offload_inter_node_bytes_at_most_055x(results, name):
    for rank_result in results:
        plain = step_deltas(rank_result[name]["plain"], "inter_node_allgather_bytes")
        fcdp = step_deltas(rank_result[name]["fcdp"], "inter_node_allgather_bytes")
        for p, f in zip(plain[1:], fcdp[1:]):
            assert f <= 0.55 * p, (plain, fcdp)
