"""Invalidation: every value-changing event matches plain ZeRO-3, and a stale cached weight (the
worst bug FCDP can have) is seen by the tests and by verify mode."""
from __future__ import annotations

import tempfile

import pytest
import torch

from conftest import run_ranks


# -- a stale cache is caught -----------------------------------------------------------------------
def test_deleted_listeners_cost_a_refetch_not_a_wrong_weight():
    """With the optimizer's invalidation listeners deleted, every slot the step made stale is found at its next read
    (``stale_refetched``) and refetched: the losses stay ZeRO-3's ([Note: freshness by construction])."""
    for r in run_ranks("invalidation:stale_probe", 4, break_invalidation=True):
        assert r["raised"] is None
        assert r["fcdp"] == r["plain"]
        assert r["stats"]["stale_refetched"] > 0


def test_without_the_check_at_use_deleted_listeners_serve_stale_weights():
    """The broken variant: listeners deleted and the check at use skipped, the cache serves pre-step weights and
    the losses diverge from plain ZeRO-3 (so the parity tests would see it), and verify mode raises."""
    for r in run_ranks("invalidation:stale_probe", 4, break_invalidation=True, break_check=True):
        assert r["raised"] is None
        assert r["fcdp"][0] == r["plain"][0]  # first step: nothing cached yet
        assert r["fcdp"][1:] != r["plain"][1:]
    broken = run_ranks("invalidation:stale_probe", 4, break_invalidation=True, break_check=True, verify=True)
    assert all(r["raised"] and "differs from its plain ZeRO-3" in r["raised"] for r in broken)


def test_verify_mode_passes_when_correct():
    healthy = run_ranks("invalidation:stale_probe", 4, break_invalidation=False, verify=True)
    for r in healthy:
        assert r["raised"] is None and r["fcdp"] == r["plain"]
        assert r["stats"]["verified_hits"] == r["stats"]["cache_hits"] > 0
        assert r["stats"]["stale_refetched"] == 0


# -- every value-changing event --------------------------------------------------------------------
@pytest.fixture(scope="module")
def events():
    with tempfile.TemporaryDirectory() as ckpt_dir:
        yield run_ranks("invalidation:invalidation_events", 4, ckpt_dir=ckpt_dir)


@pytest.mark.parametrize("key", ["warm", "warm_fwd", "after_edit_fwd", "after_edit_train", "after_load_fwd",
                                 "after_load_train", "after_16bit_train", "after_unfreeze_train",
                                 "after_freeze_train", "unfrozen_changed"])
def test_every_event_matches_plain_zero3(events, key):
    for r in events:
        plain, fcdp = r["plain"][key], r["fcdp"][key]
        assert torch.equal(plain, fcdp) if isinstance(plain, torch.Tensor) else plain == fcdp


def test_load_checkpoint_restores_frozen_and_trainable(events):
    for r in events:
        # the FCDP engine's next forward after load equals a fresh ZeRO-3 engine loading the same checkpoint
        assert torch.equal(r["fcdp"]["after_load_fwd"], r["fcdp"]["fresh_load_fwd"])
        # ... and the load really changed something (the frozen edit was undone)
        assert not torch.equal(r["fcdp"]["after_load_fwd"], r["fcdp"]["after_edit_fwd"])


def test_event_counters(events):
    stats = events[0]["fcdp"]["stats"]
    assert stats["cache_refreshes"] >= 1  # GatheredParameters(modifier_rank=0) refreshed a cached slice
    assert stats["invalidations"]["checkpoint"] > 0 and stats["invalidations"]["optimizer_write"] > 0
    assert torch.equal(events[0]["plain"]["weights"]["blocks.0.fc.weight"],
                       events[0]["fcdp"]["weights"]["blocks.0.fc.weight"])
