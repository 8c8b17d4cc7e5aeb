"""The resolved gradient plan: ``auto`` defaults, refusals only where a mode would run and cannot, and
node accumulation that follows the accumulation steps set after ``deepspeed.initialize``.

Tolerances are test_grads.py's: the gradient modes reorder the sums, so FCDP is compared with ZeRO-3
within RTOL (measured in docs/how-it-works.md), explicit flat/rank bit for bit.
"""
from __future__ import annotations

import pytest

from conftest import run_ranks
from fcdp_deepspeed.config import FCDPConfigError
from fcdp_deepspeed.grads.plan import BufferFit, resolve_grad_plan
from test_grads import RTOL, assert_close, step_delta

FIT = BufferFit(need_bytes=5 * 2**20, budget_bytes=2**30)


# -- the pure resolution --------------------------------------------------------------------------
def test_defaults_are_auto_and_node_implies_hierarchical():
    from fcdp_deepspeed.config import parse_fcdp_config
    cfg = parse_fcdp_config({"fcdp": {"enabled": True}})
    assert (cfg.grad_reduce, cfg.grad_accumulation) == ("auto", "auto")
    assert parse_fcdp_config({"fcdp": {"enabled": True, "grad_accumulation": "node"}}).grad_reduce == "hierarchical"
    assert not resolve_grad_plan("flat", "auto", 2, 2, 4, fit=FIT).active


def test_auto_on_two_nodes_of_two_is_hierarchical_with_node_accumulation():
    plan = resolve_grad_plan("auto", "auto", 2, 2, 4, fit=FIT)
    assert (plan.grad_reduce, plan.grad_accumulation, plan.fell_back) == ("hierarchical", "node", False)
    assert plan.log_line() == ("fcdp plan: 2 nodes x 2; grad_reduce=hierarchical (auto), "
                               "grad_accumulation=node (auto, buffer 5.0 MiB/rank host)")
    assert "allocated at the first micro-step" in resolve_grad_plan("auto", "auto", 2, 2, 1, fit=FIT).log_line()


@pytest.mark.parametrize("nodes, per_node, why", [(1, 4, "one node"), (4, 1, "one rank per node")])
def test_auto_on_degenerate_layouts_is_zero3(nodes, per_node, why):
    plan = resolve_grad_plan("auto", "auto", nodes, per_node, 4, fit=FIT)
    assert (plan.grad_reduce, plan.grad_accumulation, plan.active, plan.fell_back) == ("flat", "rank", False, False)
    assert why in plan.reduce_reason
    explicit = resolve_grad_plan("hierarchical", "node", nodes, per_node, 4, path_blockers=("x. Fix: y",))
    assert explicit.grad_reduce == "flat" and explicit.fell_back and explicit.reduce_reason.startswith("fell back")


def test_auto_without_room_for_the_buffer_accumulates_per_rank():
    plan = resolve_grad_plan("auto", "auto", 2, 2, 4, fit=BufferFit(need_bytes=2**30, budget_bytes=2**20))
    assert (plan.grad_reduce, plan.grad_accumulation) == ("hierarchical", "rank")
    assert "over the 1.0 MiB fcdp.grad_buffer_budget" in plan.accumulation_reason
    # explicit node keeps what fits (per parameter) instead
    assert resolve_grad_plan("auto", "node", 2, 2, 4, fit=BufferFit(2**30, 2**20)).grad_accumulation == "node"


def test_explicit_flat_and_blocked_auto_are_zero3():
    assert not resolve_grad_plan("flat", "auto", 2, 2, 4, fit=FIT).active
    blocked = resolve_grad_plan("auto", "auto", 2, 2, 4, path_blockers=("zero_optimization.x is on. Fix: off",))
    assert (blocked.grad_reduce, blocked.grad_accumulation) == ("flat", "rank")
    unmanaged = resolve_grad_plan("auto", "auto", 2, 2, 4, accumulation_blockers=("managed. Fix: z",), fit=FIT)
    assert (unmanaged.grad_reduce, unmanaged.grad_accumulation) == ("hierarchical", "rank")


def test_explicit_modes_that_would_run_and_cannot_are_refused():
    with pytest.raises(FCDPConfigError, match="reduce_scatter"):
        resolve_grad_plan("hierarchical", "auto", 2, 2, 4, path_blockers=("reduce_scatter = false. Fix: true",))
    with pytest.raises(FCDPConfigError, match="managed"):
        resolve_grad_plan("auto", "node", 2, 2, 4, accumulation_blockers=("managed. Fix: z",))


# -- through deepspeed.initialize -----------------------------------------------------------------
HIER = {"grad_reduce": "hierarchical", "grad_accumulation": "rank"}
RS_OFF = {"reduce_scatter": False}
CASES = [  # (case, expected error substring or None, expected modes)
    ({"fcdp": HIER, "zero": {"zero_quantized_gradients": True}}, "zero_quantized_gradients", None),
    ({"fcdp": HIER, "zero": RS_OFF}, "reduce_scatter = false with contiguous_gradients = true", None),
    ({"fcdp": HIER, "zero": {**RS_OFF, "contiguous_gradients": False}}, None, ["hierarchical", "rank"]),
    ({"fcdp": {**HIER, "ranks_per_node": 4}, "zero": RS_OFF}, None, ["flat", "rank"]),  # one node: falls back
    ({"fcdp": {}, "zero": RS_OFF}, None, ["flat", "rank"]),  # auto never refuses
    ({"fcdp": {}}, None, ["hierarchical", "node"]),
    ({"fcdp": {"grad_accumulation": "node"}, "top": {"managed_gradient_accumulation": False}},
     "managed_gradient_accumulation", None),
    ({"fcdp": {"grad_accumulation": "node"}, "zero": {**RS_OFF, "contiguous_gradients": False},
      "top": {"gradient_predivide_factor": 2.0}}, "gradient_predivide_factor", None),
]


@pytest.fixture(scope="module")
def built():
    return run_ranks("grads:refusals", 4, timeout=600, cases=[case for case, _, _ in CASES])


@pytest.mark.parametrize("index", range(len(CASES)))
def test_refused_only_where_a_mode_would_run_and_cannot(built, index):
    case, needle, modes = CASES[index]
    for rank, rows in enumerate(built):
        row = rows[index]
        if needle is None:
            assert row["error"] == "ok" and row["modes"] == modes, (case, row)
        else:
            assert row["error"].startswith("FCDPConfigError") and needle in row["error"] and "Fix" in row["error"], row
        if rank == 0 and needle is None:  # one plan line per engine, on rank 0, naming each mode
            assert len(row["plan"]) == 1 and f"grad_reduce={modes[0]}" in row["plan"][0], row["plan"]
    if case["fcdp"].get("ranks_per_node") == 4:
        assert "fell back, one node" in built[0][index]["plan"][0]


NODE = {"grad_accumulation": "node"}
SCENARIOS = [
    # the defaults on 2 x 2: hierarchical + node accumulation, within the gradient modes' tolerance
    dict(name="default_ga2", fcdp={}, grad_accum=2, steps=3),
    dict(name="default_one_node", fcdp={"ranks_per_node": 4}, grad_accum=2, steps=3),
    dict(name="default_one_rank_per_node", fcdp={"ranks_per_node": 1}, grad_accum=2, steps=3),
    # DeepSpeed 0.19.8 still reduces through the hooked reduce-scatter here
    dict(name="rs_off_contiguous_off", fcdp=HIER, grad_accum=2, steps=3,
         zero={"reduce_scatter": False, "contiguous_gradients": False}),
    # accumulation steps set after initialize (Megatron-DeepSpeed), vs a run built with them
    dict(name="ga_set_later", fcdp=NODE, set_ga=4, steps=3),
    dict(name="ga_set_later_auto", fcdp={}, set_ga=4, steps=3),
    dict(name="ga_built", fcdp=NODE, grad_accum=4, steps=3),
]


@pytest.fixture(scope="module")
def parity():
    return run_ranks("grads:parity", 4, timeout=1200, scenarios=SCENARIOS)


def test_defaults_resolve_and_stay_within_tolerance(parity):
    for per_rank in parity:
        run = per_rank["default_ga2"]
        assert (run["fcdp"].stats["grad_reduce"], run["fcdp"].stats["grad_accumulation"]) == ("hierarchical", "node")
        assert run["fcdp"].stats["grad_accumulated"] > 0
        assert_close(run["plain"], run["fcdp"], RTOL)
        for name in ("default_one_node", "default_one_rank_per_node"):  # nothing to split: ZeRO-3 bit for bit
            plain, fcdp = per_rank[name]["plain"], per_rank[name]["fcdp"]
            assert (fcdp.stats["grad_reduce"], fcdp.stats["grad_accumulation"]) == ("flat", "rank")
            assert fcdp.losses == plain.losses and "grad_delivered" not in fcdp.stats


def test_reduce_scatter_off_with_contiguous_off_matches_zero3(parity):
    for per_rank in parity:
        run = per_rank["rs_off_contiguous_off"]
        assert run["fcdp"].stats["grad_delivered"] > 0  # the reducer really ran
        assert_close(run["plain"], run["fcdp"], RTOL)


@pytest.mark.parametrize("name", ["ga_set_later", "ga_set_later_auto"])
def test_accumulation_steps_set_after_initialize_keep_the_savings(parity, name):
    """335,360 vs 167,680 inter-node gradient bytes per step before the fix (the buffer was never allocated)."""
    for per_rank in parity:
        later, built = per_rank[name]["fcdp"], per_rank["ga_built"]["fcdp"]
        assert len(later.losses) == 3 * 4
        assert step_delta(later, "inter_node_grad_reduce_bytes") == step_delta(built, "inter_node_grad_reduce_bytes")
        assert later.stats["grad_buffer_host_bytes"] == built.stats["grad_buffer_host_bytes"] > 0
        assert_close(per_rank[name]["plain"], later, RTOL)


def test_a_buffer_decided_at_build_time_fails_the_byte_check():
    """The broken variant (no allocation when the accumulation steps change later) sends 4x the bytes at GA 4."""
    per_rank = run_ranks("grads:parity", 4, timeout=600, scenarios=[SCENARIOS[4], SCENARIOS[-1]],
                         break_kind="no_late_buffer")
    for run in per_rank:
        later, built = step_delta(run["ga_set_later"]["fcdp"], "inter_node_grad_reduce_bytes"), \
            step_delta(run["ga_built"]["fcdp"], "inter_node_grad_reduce_bytes")
        assert later[-1] == 4 * built[-1], (later, built)  # every micro-step of the 4 crosses nodes
