"""Strict device mode (``FCDP_STRICT_DEVICE=1``): the CUDA discipline of FCDP's host/accelerator traffic,
checked on the CPU accelerator, 2 nodes x 2 ranks, through ``deepspeed.initialize``.

The strict door (``fcdp_deepspeed.strict_device``) makes the door's host memory a ``HostTensor``: mixing it
with accelerator tensors raises, a collective refuses it (as NCCL would), staging host slots before a
gather runs as on CUDA, and every blocking host/accelerator operation is logged with its call site. Steady
state: from the second optimizer step on (the first fills the cache and builds the reduction index).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import run_ranks
from fcdp_deepspeed.tools.launch import RankFailure

NODE = {"grad_accumulation": "node"}
FLAT = {"grad_reduce": "flat", "grad_accumulation": "rank"}  # ZeRO-3's gradient path (the defaults are auto)
SCENARIOS = [
    # cache only, host slots (staged to the accelerator before every gather), flat gradients: bit-identical
    dict(name="host_full_flat", fcdp={"cache_device": "host", **FLAT}, grad_accum=2, steps=3),
    # host node buffer, last block gated off in the boundary micro-step: the flush path runs
    dict(name="host_full_node_gated", fcdp={"cache_device": "host", **NODE}, grad_accum=4, gate={3}, steps=3),
    dict(name="host_lora_flat", fcdp={"cache_device": "host", **FLAT}, grad_accum=2, lora_rank=2, steps=3),
    dict(name="device_lora_node", fcdp={"cache_device": "device", **NODE}, grad_accum=2, lora_rank=2, steps=3),
    dict(name="device_full_flat", fcdp={"cache_device": "device", **FLAT}, grad_accum=2, steps=3),
    # fcdp.param_compression: pinned host references copied to the accelerator and back on the gather stream
    dict(name="host_full_int8", fcdp={"cache_device": "host", **FLAT, "param_compression": "int8"}, grad_accum=2,
         steps=3, lossy=True),
]
BY_NAME = {s["name"]: s for s in SCENARIOS}
RTOL = 1e-5  # node accumulation reorders the gradient sum (tests/test_grads.py)


@pytest.fixture(scope="module")
def strict():
    return run_ranks("device_discipline:strict_runs", 4, timeout=900, scenarios=SCENARIOS)


def steady_excess(runs: dict) -> list[str]:
    """Per steady-state step: FCDP's own blocking operations, and any beyond plain ZeRO-3's (same measure)."""
    problems = []
    for step, (plain, fcdp) in enumerate(zip(runs["plain"]["syncs"], runs["fcdp"]["syncs"])):
        if step == 0:
            continue
        own = [site for _, owner, site in fcdp if owner == "fcdp"]
        if own:
            problems.append(f"step {step}: FCDP blocks at {sorted(set(own))}")
        extra = Counter((k, o) for k, o, _ in fcdp) - Counter((k, o) for k, o, _ in plain)
        if extra:
            problems.append(f"step {step}: beyond plain ZeRO-3: {dict(extra)} at "
                            f"{sorted({s for k, o, s in fcdp if (k, o) in extra})}")
    return problems


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_strict_mode_runs_and_matches_zero3(strict, name):
    sc = BY_NAME[name]
    for per_rank in strict:
        plain, fcdp = per_rank[name]["plain"], per_rank[name]["fcdp"]
        assert fcdp["door"] == "StrictDoor" and fcdp["optimizer"] == "FCDPStage3"
        assert fcdp["stats"]["cache_hits"] > 0
        if sc["fcdp"]["cache_device"] == "host":
            assert fcdp["stats"]["h2d_async_copies"] > 0  # the staging path ran, as on CUDA
        if sc.get("gate"):
            assert fcdp["stats"]["grad_flushed"] > 0  # the host-buffer flush ran
        if sc.get("lora_rank"):
            assert fcdp["stats"]["batched_refills"] > 0  # the stale adapters' batched two-stage refill ran
        if sc.get("lossy"):  # compressed reconstructions: close to ZeRO-3, not equal (tests/test_compress_params.py)
            assert fcdp["stats"]["param_compressed_gathers"] > 0 and fcdp["stats"]["param_reference_host_pool_bytes"] > 0
            for a, b in zip(plain["losses"], fcdp["losses"]):
                assert abs(a - b) <= 1e-2 * abs(a)
        elif sc["fcdp"].get("grad_accumulation") == "node":
            for a, b in zip(plain["losses"], fcdp["losses"]):
                assert abs(a - b) <= RTOL * abs(a)
            for key, w in plain["weights"].items():
                assert (fcdp["weights"][key] - w).norm() <= RTOL * w.norm(), key
        else:  # the cache alone: bit-identical
            assert fcdp["losses"] == plain["losses"]
            for key, w in plain["weights"].items():
                assert torch.equal(w, fcdp["weights"][key]), key


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_no_blocking_host_device_operation_beyond_zero3(strict, name):
    for per_rank in strict:
        assert not steady_excess(per_rank[name])


def test_host_buffer_in_a_collective_is_refused():
    """Bug put back: the flush hands host buffer slots to the inter-node collective (NCCL would crash)."""
    with pytest.raises(RankFailure, match=r"HostTensorInCollective: fcdp: \S*grads/collectives.py:\d+ _scatter_sum handed a "
                                          r"host tensor to all_to_all_single"):
        run_ranks("device_discipline:strict_runs", 4, timeout=600, scenarios=[BY_NAME["host_full_node_gated"]],
                  break_kind="host_flush")


def test_blocking_fill_is_counted():
    """Bug put back: the cache fill waits for its copy on the host (once per parameter, per release)."""
    per_rank = run_ranks("device_discipline:strict_runs", 4, timeout=600, scenarios=[BY_NAME["host_full_flat"]],
                         break_kind="blocking_fill")
    problems = steady_excess(per_rank[0]["host_full_flat"])
    assert problems and "stream_synchronize" in problems[0], problems


def test_blocking_reference_copy_is_counted():
    """Bug put back: the compressed gather waits on the host for the copy of the new reference into pinned memory."""
    per_rank = run_ranks("device_discipline:strict_runs", 4, timeout=600, scenarios=[BY_NAME["host_full_int8"]],
                         break_kind="blocking_reference")
    problems = steady_excess(per_rank[0]["host_full_int8"])
    assert problems and "event_synchronize" in problems[0], problems


def test_index_built_per_bucket_is_counted():
    """Bug put back: the reduction's permutation index is built from a Python list on every bucket."""
    per_rank = run_ranks("device_discipline:strict_runs", 4, timeout=600, scenarios=[BY_NAME["device_lora_node"]],
                         break_kind="index_per_bucket")
    problems = steady_excess(per_rank[0]["device_lora_node"])
    assert problems and "h2d_from_python" in problems[0], problems


def test_strict_door_tells_host_from_accelerator():
    """In-process: the subclass survives ops, mixing raises, the door's copies cross, pageable copies are logged."""
    from fcdp_deepspeed import strict_device as sd
    door = sd.StrictDoor()
    host = door.pin_empty(4, torch.float32).zero_()
    assert isinstance(torch.cat([host, host]), sd.HostTensor) and isinstance(host.double()[1:], sd.HostTensor)
    accel = door.to_accel(host)
    assert type(accel) is torch.Tensor and not door.is_host(accel)
    with pytest.raises(sd.DeviceMismatchError, match="mixes host and accelerator"):
        host.add_(torch.ones(4))
    assert door.to_host(accel + 1, out=host) is host and float(host.sum()) == 4.0
    mark = sd.LOG.mark()
    door.to_host(accel, out=door.host_empty(4, torch.float32))  # pageable: blocks on CUDA
    host.copy_(accel)  # a copy outside the door, not asynchronous
    assert [e.kind for e in sd.LOG.since(mark)] == ["blocking_copy_pageable", "blocking_copy"]
