"""A stale cached weight is the worst bug FCDP can have: prove the tests and verify mode see one."""
from __future__ import annotations

from conftest import run_ranks


def test_broken_invalidation_changes_losses():
    """With invalidation switched off, the cache serves pre-step weights and losses diverge from
    plain ZeRO-3: the parity tests would fail on a missing invalidation."""
    res = run_ranks("stale_probe", 4, break_invalidation=True)
    for r in res:
        assert r["raised"] is None
        assert r["fcdp"][0] == r["plain"][0]  # first step: nothing cached yet
        assert r["fcdp"][1:] != r["plain"][1:]


def test_verify_mode_raises_on_stale_cache_and_passes_when_correct():
    broken = run_ranks("stale_probe", 4, break_invalidation=True, verify=True)
    assert all(r["raised"] and "differs from its plain ZeRO-3" in r["raised"] for r in broken)
    healthy = run_ranks("stale_probe", 4, break_invalidation=False, verify=True)
    for r in healthy:
        assert r["raised"] is None and r["fcdp"] == r["plain"]
        assert r["stats"]["verified_hits"] == r["stats"]["cache_hits"] > 0
