"""The gradient's inter-node stage behind the backward (issue 31 item 3, ``grads/inflight.py``): issued per bucket
with ``async_op=True`` and delivered later in FIFO order, on real gloo groups (2 nodes x 2, rank 2 issuing late).

Values: every element is summed in the same order whatever its bucket and whenever its stage completes ([Note:
bucket-sized work] in ``engine/grad_steps.py``), so the overlapped path is bit-identical to the synchronous one (DeepSpeed's
one bucket, each stage waited for where it is issued) under node and per-rank accumulation, with a block that gets no
gradient in the boundary micro-step (the flush) and with reentrant checkpointing (several epilogues per backward);
``grad_reduce: flat`` keeps DeepSpeed's buckets and stays bit-identical to ZeRO-3. The window's first bucket leaves
early and issues its stage 2 at once (grads/reducer.py, engine/grad_steps.py): covered by the same identities. Broken variants
(``fcdp_lab/sabotage/grads.py``): reading a stage's result before it completed, a backward's end that does not deliver
what is in flight, and workspace buffers given back at issue ([Note: when a buffer may be reused]), each change the
values. The stream-order model's variant is in test_device_discipline.py.
"""
from __future__ import annotations

import pytest
import torch

from conftest import run_ranks

SCENARIOS = [
    dict(name="ga1", steps=3, breaks=("read_early", "no_drain", "workspace_early")),
    # the last block gets no gradient in the boundary micro-step: its window sum goes through the flush
    dict(name="ga4_gated", grad_accum=4, gate={3}, steps=2, modes=("node", "rank", "int8")),
    dict(name="ga2_reentrant", grad_accum=2, reentrant=True, steps=2, modes=("node",)),
]
EXACT = [(s["name"], m) for s in SCENARIOS for m in s.get("modes", ("node", "rank")) if m != "int8"]


@pytest.fixture(scope="module")
def results():
    return run_ranks("grad_overlap:variants", 4, timeout=900, scenarios=SCENARIOS)


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_flat_keeps_deepspeeds_buckets_and_is_bit_identical_to_zero3(results, name):
    for r in results:
        assert _same(r[name]["flat"], r[name]["plain"])
        assert r[name]["flat"]["bucket"] == r[name]["plain"]["bucket"]


@pytest.mark.parametrize("name, mode", EXACT)
def test_overlapped_stage_is_bit_identical_to_the_synchronous_one(results, name, mode):
    for r in results:
        sync, overlap = r[name][f"{mode}_sync"], r[name][f"{mode}_overlap"]
        assert _same(overlap, sync)
        assert overlap["bucket"] == 256 and sync["bucket"] == r[name]["plain"]["bucket"]
        # stages were in flight behind later buckets (two allowed, the third completes the oldest)
        assert overlap["stats"]["grad_inflight_max"] >= 2 and sync["stats"]["grad_inflight_max"] <= 1  # sync: the flush
        # each window's first bucket left at a quarter of the bucket and its stage 2 went at once ([Note: the first
        # bucket leaves early], [Note: nothing across, nothing kept]); the synchronous path has neither
        assert overlap["stats"]["grad_first_bucket_early"] >= 1 and overlap["stats"]["grad_stage2_at_once"] >= 1
        assert sync["stats"]["grad_first_bucket_early"] == 0 == sync["stats"]["grad_stage2_at_once"]


@pytest.mark.parametrize("name, mode", EXACT)
def test_the_stages_buffers_are_a_fixed_workspace(results, name, mode):
    """[Note: a fixed workspace per stage] (grads/workspace.py): nothing is allocated for the stages after the first
    window (every later bucket reuses the pools), one packed input and one stage-1 receive buffer at a time ([Note:
    one packed input]), and at most ``grad_inflight_buckets`` + 1 stage-2 pairs."""
    for r in results:
        for kind, depth in (("overlap", 2), ("sync", 0)):  # workers/grad_overlap.py: OVERLAP, SYNC
            steps = r[name][f"{mode}_{kind}"]["workspace"]
            assert len(steps) >= 2 and steps[0]["grad_workspace_allocations"] > 0
            assert steps[-1]["grad_workspace_allocations"] == steps[0]["grad_workspace_allocations"], steps
            assert steps[-1]["grad_workspace_bytes"] == steps[0]["grad_workspace_bytes"], steps
            peak = steps[-1]["grad_workspace_peak_leases"]
            assert peak["pack"] == 1 and peak["node_recv"] == 1, peak
            assert 1 <= peak["peer_send"] == peak["peer_recv"] <= depth + 1, peak
            if kind == "overlap":
                assert peak["peer_send"] >= 2, peak  # stages were in flight behind later buckets


def test_compressed_stage_overlaps_and_stays_close(results):
    """int8 encodes at issue and decodes at completion; its blocks follow the buckets, so values differ within the
    codec's error (replicas stay equal: tests/test_compress_grads.py)."""
    for r in results:
        sync, overlap = r["ga4_gated"]["int8_sync"], r["ga4_gated"]["int8_overlap"]
        assert overlap["stats"]["grad_inflight_max"] >= 2 and overlap["stats"]["grad_compressed_exchanges"] > \
            sync["stats"]["grad_compressed_exchanges"]
        assert torch.allclose(torch.tensor(overlap["losses"]), torch.tensor(sync["losses"]), rtol=2e-2), \
            (overlap["losses"], sync["losses"])


@pytest.mark.parametrize("broken", ["read_early", "no_drain", "workspace_early"])
def test_broken_variants_change_the_values(results, broken):
    assert any(r["ga1"][f"broken_{broken}"]["losses"] != r["ga1"]["node_overlap"]["losses"] for r in results)


def test_issue_does_not_wait_for_a_late_peer():
    """gloo: rank 2 issues each inter-node stage 0.2 s late; its peer rank 0's issues return at once (the wait is at
    completion, behind the rest of the backward or in its epilogue)."""
    per_rank = run_ranks("grad_overlap:issue_does_not_wait", 4, timeout=600, delay_s=0.2)
    r0 = next(r for r in per_rank if r["rank"] == 0)
    assert len(r0["issue_s"]) >= 8 and max(r0["issue_s"]) < 0.1, r0["issue_s"]
    assert r0["inter_node_s"] >= 0.2  # it waited for the late peer at completion instead


@pytest.mark.parametrize("key, value", [("grad_bucket_size", -1), ("grad_bucket_size", "big"), ("grad_bucket_size", 1.5),
                                        ("grad_bucket_size", True), ("grad_inflight_buckets", -1),
                                        ("grad_inflight_buckets", True)])
def test_bad_values_name_the_key(key, value):
    from fcdp_deepspeed.config import FCDPConfigError, parse_fcdp_config
    with pytest.raises(FCDPConfigError, match=f"fcdp.{key} = "):
        parse_fcdp_config({"fcdp": {"enabled": True, key: value}})


def test_auto_bucket_cap():
    """[Note: bucket-sized work]: about eight buckets, never under 2**18 elements nor above DeepSpeed's value."""
    from fcdp_deepspeed.engine.grad_steps import bucket_cap
    assert bucket_cap("auto", 2_630_000, 500_000_000) == 328_750  # the bench model: 8 buckets
    # a 7B model: a third of DeepSpeed's ([Note: the bucket pays for the stages in flight])
    assert bucket_cap("auto", 7 * 10**9, 500_000_000) == 166_666_666
    assert bucket_cap("auto", 1_200_000_000, 500_000_000) == 150_000_000  # its eighth is under a third
    assert bucket_cap("auto", 10**9, 600_000) == 2**18  # never under the minimum
    assert bucket_cap("auto", 4_000, 500_000_000) == 2**18  # the test toys: one bucket
    assert bucket_cap(0, 10**9, 5) == 5 and bucket_cap(100, 10**9, 500) == 100 and bucket_cap(100, 10, 50) == 50


# -- the committed run (docs/bench_grad_overlap_ga{1,4}_results.json): before = fcdp_node_syncgrad, after = fcdp_node --
BENCH_RUNS = ("results/bench/grad-overlap-ga1.json", "results/bench/grad-overlap-ga4.json")


def _bench_rows(name: str) -> dict:
    import json
    from pathlib import Path
    rows = json.loads((Path(__file__).resolve().parent.parent / "docs" / name).read_text())["rows"]
    return {(r["rate_mbit"], r["engine"]): r for r in rows if not r.get("computed")}


@pytest.mark.parametrize("name", BENCH_RUNS)
def test_committed_run_same_values_and_bytes_less_inter_node_waiting(name):
    rows = _bench_rows(name)
    for rate in (100.0, 0.0):
        after, before = rows[(rate, "fcdp_node")], rows[(rate, "fcdp_node_syncgrad")]
        assert after["losses"] == before["losses"]  # bit for bit, every micro-step of the run
        assert after["counted_inter_node_bytes_per_step"] == before["counted_inter_node_bytes_per_step"]
    after, before = rows[(100.0, "fcdp_node")], rows[(100.0, "fcdp_node_syncgrad")]
    assert after["timeline_s"]["grad_inter_node"] < 0.6 * before["timeline_s"]["grad_inter_node"]
    assert after["step_vs_floor"] < before["step_vs_floor"]
