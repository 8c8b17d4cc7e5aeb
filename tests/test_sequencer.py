"""Stage 1 asynchronous on gloo, stage 2 issued in FIFO order by the waits (``runtime/sequencer.py``), and a
coalesced fetch gathered per module (``runtime/gather.py``'s ``PerModuleHandle``): values bit-identical to ZeRO-3
with a late peer in both release regimes, the host not blocked at issue; each broken ordering fails."""
from __future__ import annotations

import pytest

from conftest import run_ranks


@pytest.fixture(scope="module")
def late():
    # rank 2 issues every stage 1 0.2 s late (skew): a read before completion would show
    return run_ranks("sequencer:late_peer", 4, timeout=600, env={"FCDP_LAB_BREAK": "gather.delay@2=0.2"})


def test_waits_in_per_rank_order_issue_stage_two_in_fifo_order():
    for r in run_ranks("sequencer:wait_orders", 4):
        assert r["queued"] and r["exact"] == [True, True], r


def test_stage_two_in_each_rank_s_wait_order_gives_wrong_values():
    results = run_ranks("sequencer:wait_orders", 4, broken="drain_own")
    assert any("error" in r or r["exact"] != [True, True] for r in results), results


def test_a_coalesced_fetch_completes_only_the_modules_waited_for():
    for r in run_ranks("sequencer:wait_orders", 4):
        assert r["first_wait"] == ["AVAILABLE", "INFLIGHT"], r  # b's module is not active yet
        assert r["second_wait"] == ["AVAILABLE", "AVAILABLE"] and r["exact_split"] == [True, True], r


@pytest.mark.parametrize("regime", ["large", "default"])
def test_bit_identical_to_zero3_with_a_late_peer(late, regime):
    for r in late:
        assert r[f"{regime}_fcdp"]["losses"] == r[f"{regime}_plain"]["losses"]
        assert r[f"{regime}_fcdp"]["stats"]["hierarchical_gathers"] > 0


@pytest.mark.parametrize("regime", ["large", "default"])
def test_stage_two_before_stage_one_completes_changes_the_values(late, regime):
    assert any(r[f"{regime}_early"]["losses"] != r[f"{regime}_plain"]["losses"] for r in late)


def test_the_host_does_not_wait_for_stage_one_at_issue():
    """Rank 2 starts 0.3 s late: its peer rank 0 returns from the issue at once and waits in the handle."""
    r0 = run_ranks("sequencer:never_blocks_at_issue", 4)[0]
    assert r0["exact"] == [True]
    assert r0["issue_s"] < 0.1 and r0["wait_s"] >= 0.2, r0
