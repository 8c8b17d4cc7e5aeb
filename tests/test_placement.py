"""Cache placement: the pure policy, host / device / auto, budgets, the pooled (pinned) host buffer,
and pool allocations that fail (degrade to plain ZeRO-3 without changing a loss)."""
from __future__ import annotations

import pytest
import torch

from conftest import run_ranks
from fcdp_deepspeed.storage.cache import Placement
from fcdp_deepspeed.storage.placement import SlotRequest, plan_placement


#: Per node; half of it per rank (L = 2). The toy model's slices need 12672 bytes per rank.
SMALL_BUDGET = 2 * 6000


# -- policy ----------------------------------------------------------------------------------------
def test_placement_prefers_frozen_and_respects_budgets():
    reqs = [SlotRequest(0, 100, frozen=False), SlotRequest(1, 100, frozen=True), SlotRequest(2, 100, frozen=True)]
    plan = plan_placement(reqs, "device", host_budget=100, device_budget=100)
    assert plan == {1: Placement.DEVICE, 2: Placement.HOST, 0: None}
    plan = plan_placement(reqs, "host", host_budget=250, device_budget=10**9)
    assert plan == {1: Placement.HOST, 2: Placement.HOST, 0: None}
    assert all(v is Placement.HOST for v in plan_placement(reqs, "auto", 10**9, 10**9).values())


# -- modes and budgets -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modes():
    return run_ranks("placement:placement_modes", 4, steps=5, host_budget_bytes=SMALL_BUDGET)


@pytest.mark.parametrize("mode", ["host", "device", "auto", "small_budget"])
def test_every_mode_matches_plain_zero3(modes, mode):
    for r in modes:
        assert r[mode].losses == r["plain"].losses


def test_host_mode_has_zero_device_overhead(modes):
    for r in modes:
        for s in r["host"].step_stats:
            assert s["device_pool_bytes"] == 0 and s["device_cache_bytes"] == 0
        assert r["host"].stats["host_pool_bytes"] == 12672


def test_device_mode_places_slices_on_the_accelerator_after_a_measured_step(modes):
    """[Note: device budgets come from a measured step]: like auto, device mode starts on the host; after step 2
    every slice that fits the measured headroom moves, and the host chunks are released."""
    r = modes[0]["device"]
    assert r.step_stats[0]["device_pool_bytes"] == 0 and r.step_stats[0]["host_pool_bytes"] == 12672
    assert r.step_stats[1]["device_pool_bytes"] == 12672 and r.stats["host_pool_bytes"] == 0
    m = r.stats["memory"]
    assert m["device_headroom_bytes"] > 0 and m["device_budget_bytes"] == m["device_headroom_bytes"]
    a = modes[0]["auto"].stats["memory"]  # auto: half the headroom by default
    assert 0 < a["device_budget_bytes"] <= a["device_headroom_bytes"] // 2 + 1


def test_memory_numbers_are_reported(modes):
    """Pinning time, and the node's resident memory (all its ranks: SLURM's limit is per node) identical on the
    ranks of one node (broken variant: each rank's own resident memory, as before, differs between them)."""
    for mode in ("host", "device", "auto"):
        s = [r[mode].stats["memory"] for r in modes]
        assert all(x["host_pool_alloc_seconds"] >= 0 and x["comm_warmup_seconds"] >= 0 for x in s)
        assert s[0]["node_resident_bytes"] == s[1]["node_resident_bytes"] > 0
        assert s[2]["node_resident_bytes"] == s[3]["node_resident_bytes"] > 0
        assert set(s[0]["comm_warmup_bytes"]) == {"node", "node_peers"}


def test_auto_mode_promotes_after_the_second_step(modes):
    """Step 1 has no prefetch trace, so auto measures after step 2 (the first complete step)."""
    r = modes[0]["auto"]
    assert r.step_stats[0]["device_pool_bytes"] == 0 and r.step_stats[0]["host_pool_bytes"] == 12672
    assert r.step_stats[1]["device_pool_bytes"] == 12672 and r.stats["host_pool_bytes"] == 0
    assert any("moved 12 cached slices" in m and "after step 2" in m for m in r.extra["log"])


def test_pool_is_allocated_once(modes):
    for mode in ("host", "device", "small_budget", "auto"):
        stats = modes[0][mode].step_stats[1 if mode in ("auto", "device") else 0:]  # promoted at step 2
        counts = [(s["host_pool_allocations"], s["device_pool_allocations"]) for s in stats]
        assert len(set(counts)) == 1, (mode, counts)  # nothing allocated per step


def test_small_host_budget_caches_only_what_fits(modes):
    for r in modes:
        small, full = r["small_budget"], r["host"]
        assert 0 < small.stats["host_pool_bytes"] <= SMALL_BUDGET // 2
        assert small.stats["uncached_params"] >= 1 and small.stats["uncached_bytes"] > 0
        assert small.stats["uncached_fetches"] > 0  # the rest takes the plain ZeRO-3 path ...
        assert small.stats["inter_node_allgather_bytes"] > full.stats["inter_node_allgather_bytes"]  # ... across nodes
    warnings = modes[0]["small_budget"].extra["warnings"]
    assert len(warnings) == 1 and "fcdp.host_budget" in warnings[0] and "do not fit" in warnings[0]
    assert all(not r["small_budget"].extra["warnings"] for r in modes[1:])  # one warning, from rank 0


# -- allocation faults -----------------------------------------------------------------------------
def test_allocation_failure_on_one_rank_degrades_those_parameters_everywhere(monkeypatch):
    # rank 1's 2nd host chunk fails: its parameters go plain ZeRO-3 on all ranks (hit/miss must agree)
    monkeypatch.setenv("FCDP_INJECT_FAULT", "alloc_host@1:2")
    res = run_ranks("placement:degraded_allocation", 4)
    for r in res:
        assert r["fcdp"] == r["plain"]
        stats = r["stats"]
        assert 0 < stats["uncached_params"] < stats["uncached_params"] + stats["cached_params"]
        assert stats["cache_hits"] > 0 and stats["uncached_fetches"] > 0
    warnings = [m for m in res[0]["log"] if "allocation failed" in m]
    assert len(warnings) == 1 and "plain ZeRO-3 path on every rank" in warnings[0]


def test_allocation_failure_everywhere_runs_plain_zero3(monkeypatch):
    monkeypatch.setenv("FCDP_INJECT_FAULT", "alloc_host")
    for r in run_ranks("placement:degraded_allocation", 4):
        assert r["fcdp"] == r["plain"] and r["stats"]["cached_params"] == 0 and r["stats"]["cache_hits"] == 0


# -- one node --------------------------------------------------------------------------------------
def test_one_node_takes_no_cache_memory_and_is_plain_zero3():
    """All ranks on one node (the hostname layout, or ranks_per_node = world): no slot, no gradient
    buffer, one log line, bit-identical to ZeRO-3, and FCDP's counters still report."""
    res = run_ranks("placement:one_node", 4, timeout=600)
    for rank, r in enumerate(res):
        plain = r["plain"]
        for name in ("hostname", "rpn4"):
            f = r[name]
            assert f.extra["optimizer_class"] == "FCDPStage3" and f.extra["pools"] == 0
            s = f.stats
            assert s["num_nodes"] == 1 and s["cached_params"] == 0 and s["cache_hits"] == 0
            assert s["host_pool_bytes"] == s["device_pool_bytes"] == s["pinned_pool_bytes"] == 0
            assert s.get("grad_buffer_host_bytes", 0) == s.get("grad_buffer_device_bytes", 0) == 0
            assert s["uncached_fetches"] > 0 and s["optimizer_steps"] == 3  # counters still report
            assert f.losses == plain.losses
            assert all(torch.equal(plain.weights[k], f.weights[k]) for k in plain.weights)
            logs = f.extra["log"]
            if rank == 0:
                assert len(logs) == 1 and "one node" in logs[0] and "no cache slots, no gradient buffer" in logs[0]
            else:
                assert logs == []


# -- pinning ---------------------------------------------------------------------------------------
def test_pageable_host_memory_is_said_once(monkeypatch):
    """[Note: pageable host memory] On an accelerator that pins (monkeypatched: the CPU cannot), a pageable pool
    gets one warning naming fcdp.pin_memory, a pinned one the info line with the pinning time; DeepSpeed's own
    pageable offloaded partitions are recognised (offload_param's pin_memory defaults to false)."""
    from fcdp_deepspeed.machine import device
    from fcdp_deepspeed.reporting.stats import CacheCounters
    from fcdp_deepspeed.runtime import allocation
    from fcdp_deepspeed.storage.cache import NodeCache, SlotPool
    said = []
    monkeypatch.setattr(allocation.logger, "warning", lambda m: said.append(("warning", m)))
    monkeypatch.setattr(allocation.logger, "info", lambda m: said.append(("info", m)))
    monkeypatch.setattr(allocation.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(device, "pins_host_memory", lambda: True)
    cache = NodeCache(0, CacheCounters(), checksums=False)
    for pin in (False, True):
        cache.pools[Placement.HOST] = SlotPool(Placement.HOST, pin=pin)
        allocation.Allocation(config=None, dp_group=None, topology=None, cache=cache).log_pinning()
    assert [kind for kind, _ in said] == ["warning", "info"]
    assert "fcdp.pin_memory is false" in said[0][1] and "synchronous copy" in said[0][1]
    assert "pinning and zeroing included" in said[1][1]
    zero = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert allocation.offloaded_pageable(zero)
    zero["zero_optimization"]["offload_param"]["pin_memory"] = True
    assert not allocation.offloaded_pageable(zero) and not allocation.offloaded_pageable({"zero_optimization": {}})
