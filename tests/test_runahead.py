"""Stage 1 run ahead at the step's end (``fcdp.param_push_bytes``, runtime/runahead.py) and from the window's first
fetch (``fcdp.param_runahead_bytes``, the default): bit-identical to ZeRO-3, never read before complete, never read
stale; each broken variant changes the values."""
from __future__ import annotations

import tempfile

import pytest
import torch

from conftest import run_ranks


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as ckpt_dir:
        # rank 2 pushes 0.3 s late (skew): a read before completion would show
        return run_ranks("runahead:variants", 4, ckpt_dir=ckpt_dir, env={"FCDP_LAB_BREAK": "push.delay@2=0.3"})


def test_runahead_bit_identical_to_zero3_and_used(results):
    for r in results:
        assert r["fcdp"]["losses"] == r["plain"]["losses"]
        assert torch.equal(r["fcdp"]["out"], r["plain"]["out"]) and torch.equal(r["fcdp"]["out2"], r["plain"]["out2"])
        s = r["fcdp"]["stats"]
        assert s["param_push_used"] > 0 and s["param_push_groups"] >= s["param_push_used"]
        assert s["param_push_cancelled"] >= 1  # the checkpoint load after a step
        assert s["timeline_view"] == "host" and s["timeline_forward_gather_calls"] > 0


def test_a_rolling_push_is_bit_identical_and_issues_as_fetches_take(results):
    """A budget of about one group: the step's end pushes the first group, each fetch that takes one issues the next
    (``param_push_rolled``), and the values are ZeRO-3's; the same budget with invalidations skipped is stale (the
    group pushed at the step's end survives the checkpoint load)."""
    for r in results:
        assert r["rolling"]["losses"] == r["plain"]["losses"]
        assert torch.equal(r["rolling"]["out"], r["plain"]["out"]) and torch.equal(r["rolling"]["out2"], r["plain"]["out2"])
        s, full = r["rolling"]["stats"], r["fcdp"]["stats"]
        assert s["param_push_rolled"] > 0 and s["param_push_groups"] < full["param_push_groups"], (s, full)
        assert s["param_push_used"] >= s["param_push_rolled"]
        # the same budget with invalidations skipped: the group pushed at the step's end survives the checkpoint load,
        # and the check at use drops it when its fetch comes ([Note: freshness by construction])
        skipped = r["rolling_skip_invalidation"]
        assert skipped["losses"] == r["plain"]["losses"] and torch.equal(skipped["out"], r["plain"]["out"])
        assert skipped["stats"]["param_push_stale"] > 0 and skipped["stats"]["stale_refetched"] > 0


def test_waits_for_the_late_peer(results):
    """Rank 2 pushes 0.3 s late: its peer rank 0 waits in push_wait instead of reading early."""
    s = results[0]["fcdp"]["stats"]
    assert s["timeline_push_wait_s"] >= 0.2


def test_reading_before_complete_changes_values(results):
    assert any(r["read_early"]["losses"] != r["plain"]["losses"] for r in results)


def test_a_push_that_skips_an_invalidation_is_caught_at_use(results):
    """The cancel listener deleted: the pushed groups older than the load are found at their fetch and gathered
    anew, so the values stay ZeRO-3's; with the check at use skipped too (the broken variant) they are stale."""
    for r in results:
        skipped, unchecked = r["skip_invalidation"], r["skip_invalidation_unchecked"]
        assert skipped["losses"] == r["plain"]["losses"] and torch.equal(skipped["out"], r["plain"]["out"])
        assert skipped["stats"]["param_push_stale"] > 0
        assert r["fcdp"]["stats"]["param_push_stale"] == 0 and r["fcdp"]["stats"]["stale_refetched"] == 0
        assert unchecked["losses"][:4] == r["plain"]["losses"][:4]  # before the load
        assert not torch.equal(unchecked["out"], r["plain"]["out"])


def test_with_deepspeed_s_prefetch_every_push_is_used():
    """Default regime: the first window fetches module by module, the next ones prefetch the rest of the forward in
    one coalesced fetch; both are gathered per module, so every push is used and the values are ZeRO-3's."""
    for r in run_ranks("runahead:prefetch", 4):
        assert r["fcdp"]["losses"] == r["plain"]["losses"]
        s = r["fcdp"]["stats"]
        assert s["param_push_used"] > 0 and s["param_push_unused"] == 0, s


def test_from_the_first_fetch_bit_identical_and_nothing_crosses_for_nothing(results):
    """The default run-ahead ([Note: from the window's first fetch]): issued at each window's first two-stage gather
    and used, the values ZeRO-3's; the checkpoint load and the ``GatheredParameters`` edit between steps cancel
    nothing (nothing had crossed yet), and no group crossed unused."""
    for r in results:
        for name in ("window", "window_rolling"):
            assert r[name]["losses"] == r["plain"]["losses"], name
            assert torch.equal(r[name]["out"], r["plain"]["out"]) and torch.equal(r[name]["out2"], r["plain"]["out2"])
            s = r[name]["stats"]
            assert s["param_push_groups"] > 0 and s["param_push_used"] > 0, (name, s)
            assert s["param_push_cancelled"] == 0 and s["param_push_unused"] == 0, (name, s)
        assert r["window_rolling"]["stats"]["param_push_rolled"] > 0


def test_from_the_first_fetch_reading_before_complete_changes_values(results):
    """Rank 2 is late into each window (its step's end sleeps): a stage 2 that does not wait reads its slot early."""
    assert any(r["window_read_early"]["losses"] != r["plain"]["losses"] for r in results)


def test_a_one_group_plan_runs_nothing_ahead(results):
    """LoRA: the plan is the batched refill of every adapter, the first fetch's own group, so nothing is issued ahead
    ([Note: one group runs nothing ahead]): the refill still batches, and the values are ZeRO-3's."""
    for r in (run["lora"] for run in results):
        assert r["fcdp"]["losses"] == r["plain"]["losses"]
        assert torch.equal(r["fcdp"]["out"], r["plain"]["out"])
        steady = r["fcdp"]["steady"]  # after the first two windows: every plan is the batched refill alone
        assert steady["param_push_groups"] == 0 and steady["batched_refills"] == 3, steady


def test_compressed_groups_run_ahead_with_the_bits_of_their_own_fetch(results):
    """``fcdp.param_compression`` int4 ([Note: compressed groups run ahead]): from the window's first fetch and pushed
    from the step's end, compressed groups are issued ahead and used, and every loss and output is bitwise that of
    the same job without the run-ahead (each group is encoded against the same references, decoded at its fetch's
    wait). The groups pushed at the step's end that hold the two weights the read-only ``GatheredParameters`` gathered
    together are dropped (that gather rewrote their references)."""
    for r in (run["compressed"] for run in results):
        for name, off in (("window", "off"), ("push", "off"), ("push_uncached", "off_uncached")):
            assert r[name]["losses"] == r[off]["losses"], name
            assert torch.equal(r[name]["out"], r[off]["out"]), name
            s = r[name]["stats"]
            assert s["param_push_used"] > 0 and s["param_compressed_gathers"] == r[off]["stats"]["param_compressed_gathers"], s
            assert r[off]["stats"]["param_compressed_gathers"] > 0 and "param_push_groups" not in r[off]["stats"]
        assert r["push_uncached"]["stats"]["param_push_cancelled"] >= 2, r["push_uncached"]["stats"]
        s = r["push_refresh"]["stats"]  # references dropped every 2 steps, before the push plans: nothing wasted
        assert s["param_push_used"] > 0 and s["param_push_cancelled"] == 0 and s["param_push_unused"] == 0, s


def test_compressed_run_ahead_broken_variants_change_values(results):
    """A pending compressed group kept across the gather that rewrote its references decodes against the new reference
    (``stale_reference``); a stage 2 that does not wait for the compressed stage 1 reads an undecoded bundle
    (``read_early``, rank 2 late): both change the values."""
    runs = [run["compressed"] for run in results]
    for r in runs:
        assert r["push_uncached_stale"]["losses"][:3] == r["off_uncached"]["losses"][:3]  # before the read-only gather
        assert r["push_uncached_stale"]["losses"][3] != r["off_uncached"]["losses"][3]
    assert any(r["window_read_early"]["losses"] != r["off"]["losses"] for r in runs)
