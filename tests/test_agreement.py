"""Every rank issues the same collectives in the same order (docs/how-it-works.md).

- a fetch that mixes batched-refill hits with misses the two-stage gather does not serve (an expert
  parameter of another process group, an autocast communication dtype) is split into parts that each
  take one route over one group, in an order independent of the caller's list order;
- data-parallel groups of different shapes in one job (one hierarchical, one on a single node): every
  rank creates the same process groups, whatever its own group's mode.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from conftest import run_ranks
from fcdp_deepspeed.config import FCDPConfigError, parse_fcdp_config
from fcdp_deepspeed.grads import build_reducer
from fcdp_deepspeed.machine.topology import Topology
from fcdp_deepspeed.runtime.routing import Route, split_fetch


class _Gather:
    """Stands in for HierarchicalGather.unsupported: group "dp" is the engine's, dtype bf16 is autocast."""

    def unsupported(self, params, quantize):
        p = params[0]
        if p.ds_process_group != "dp":
            return "partitioned over another process group"
        return "autocast communication dtype" if p.comm == "bf16" else ""


def _param(ds_id, hit=False, group="dp", comm="fp32"):
    return SimpleNamespace(ds_id=ds_id, ds_secondary_tensor=object() if hit else None, ds_process_group=group,
                           comm=comm)


def test_split_is_independent_of_the_list_order():
    """Hits, two-stage misses and flat misses of each group and reason are separate parts, each sorted by
    ds_id, issued by route then first ds_id: the same for every order a set may produce."""
    params = [_param(3, hit=True), _param(1, hit=True), _param(2), _param(7), _param(5, group="expert"),
              _param(4, comm="bf16"), _param(6, group="expert"), _param(8, group="other")]
    expected = [(Route.SERVED, (1, 3), ""), (Route.TWO_STAGE, (2, 7), ""),
                (Route.FLAT, (4,), "autocast communication dtype"),
                (Route.FLAT, (5, 6), "partitioned over another process group"),
                (Route.FLAT, (8,), "partitioned over another process group")]
    rng = random.Random(0)
    for _ in range(20):
        rng.shuffle(params)
        got = [(part.route, tuple(p.ds_id for p in part.params), part.reason)
               for part in split_fetch(params, _Gather(), quantize=False)]
        assert got == expected
    flat_mode = split_fetch(params, None, quantize=False)  # param_gather flat: hits apart, one part per group
    assert [(part.route, tuple(p.ds_id for p in part.params)) for part in flat_mode] == [
        (Route.SERVED, (1, 3)), (Route.FLAT, (2, 4, 7)), (Route.FLAT, (5, 6)), (Route.FLAT, (8,))]


def test_refill_hits_mixed_with_unsupported_misses():
    """LoRA adapters (batched refill), MoE-like experts partitioned over the expert-data-parallel group
    and an autocast-dtype parameter, fetched together: FCDP matches plain ZeRO-3 bit for bit (losses,
    every rank's weights, eval), and a fetch in a different order on every rank gathers exact values.
    (Before the split, the refilled hits went to DeepSpeed with the unsupported misses: the autocast
    parameter was gathered over the node group from a partition of the wrong size, and ranks crashed.)"""
    for r in run_ranks("agreement:expert_refill", 4, timeout=300):
        plain, fcdp = r["plain"], r["fcdp"]
        assert fcdp["optimizer"] == "FCDPStage3"
        assert fcdp["losses"] == plain["losses"] and torch.equal(fcdp["eval"], plain["eval"])
        for key, w in plain["weights"].items():
            assert torch.equal(w, fcdp["weights"][key]), key
        assert all(plain["exact"].values()) and all(fcdp["exact"].values()), (plain["exact"], fcdp["exact"])
        stats = fcdp["stats"]
        assert stats["batched_refills"] >= 2  # after the step and at the mixed fetch
        assert set(stats["param_gather_fallbacks"]) == {"partitioned over another process group",
                                                        "autocast communication dtype"}
        assert stats["hierarchical_gathers"] > 0  # the adapters of step 1: not dragged to the flat ring


def test_data_parallel_groups_of_different_shapes():
    """6 ranks, 2 per node, DP groups {0,1,2,3} (2 nodes x 2: two-stage gather and gradient modes) and
    {4,5} (one node: DeepSpeed's paths): FCDP engines build on every rank, a world group created
    afterwards works (every rank created the same groups), and training matches plain ZeRO-3. (Before,
    only ranks 0-3 created node-peer groups: the world group after them hung.)"""
    for rank, r in enumerate(run_ranks("agreement:uneven_dp", 6, timeout=600, dp_groups=[[0, 1, 2, 3], [4, 5]])):
        plain, fcdp = r["plain"], r["fcdp"]
        assert fcdp["optimizer"] == "FCDPStage3" and fcdp["groups_agree"] and plain["groups_agree"]
        two_stage = rank < 4
        assert fcdp["param_gather"] == ("hierarchical" if two_stage else "flat")
        assert (fcdp["grad_reduce"], fcdp["grad_accumulation"]) == (("hierarchical", "node") if two_stage
                                                                    else ("flat", "rank"))
        for a, b in zip(plain["losses"], fcdp["losses"]):  # the gradient modes' tolerance (test_grads.RTOL)
            assert abs(a - b) <= 1e-5 * abs(a), (plain["losses"], fcdp["losses"])
        for key, w in plain["weights"].items():
            assert (fcdp["weights"][key] - w).norm().item() <= 1e-5 * max(w.norm().item(), 1e-12), key
            if not two_stage:
                assert torch.equal(w, fcdp["weights"][key]), key  # DeepSpeed's own paths: bit for bit


def test_a_refusal_for_one_dp_group_is_raised_on_every_rank():
    """An explicit gradient mode that cannot run with the DeepSpeed config is refused where it would run
    (2 nodes x 2); a rank of the one-node DP group raises the same error instead of going on alone (and
    blocking at the next collective over the world). Pure: the refusal comes before any collective."""
    topo = Topology(node_of_rank=("n0", "n0", "n1", "n1", "n2", "n2"), dp_ranks=(4, 5), node_ranks=(4, 5),
                    source="test", dp_groups=((0, 1, 2, 3), (4, 5)))
    assert topo.dp_shapes == [(1, 2), (2, 2)]
    config = parse_fcdp_config({"fcdp": {"enabled": True, "grad_reduce": "hierarchical"}})
    blocker = ("zero_optimization.zero_quantized_gradients (ZeRO++ qgZ) reduces with its own quantized all-to-all. "
               "Fix: set it to false",)
    with pytest.raises(FCDPConfigError, match="cannot run with this DeepSpeed config"):
        build_reducer(config, topo, None, [], torch.float32, lambda: True, path_blockers=blocker)
