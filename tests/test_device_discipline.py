"""Strict device mode (``FCDP_STRICT_DEVICE=1``): the CUDA discipline of FCDP's host/accelerator traffic,
checked on the CPU accelerator, 2 nodes x 2 ranks, through ``deepspeed.initialize``.

The strict door (``fcdp_lab/strict/strict_device.py``) makes the door's host memory a ``HostTensor``: mixing it
with accelerator tensors raises, a collective refuses it (as NCCL would), staging host slots before a
gather runs as on CUDA, and every blocking host/accelerator operation is logged with its call site. Steady
state: from the second optimizer step on (the first fills the cache and builds the reduction index).
"""
from __future__ import annotations

import gc
import re
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from conftest import run_ranks
from fcdp_deepspeed.machine import device
from fcdp_lab.harness.launch import RankFailure

#: DeepSpeed's throughput timer synchronizes the device at every forward and step from step 2 (on CUDA too):
#: off, so FCDP's own stream orderings are what the stream-order model checks.
TOP = {"timers": {"throughput": {"enabled": True, "synchronized": False}}}
NODE = {"grad_accumulation": "node"}
FLAT = {"grad_reduce": "flat", "grad_accumulation": "rank"}  # ZeRO-3's gradient path (the defaults are auto)
SCENARIOS = [
    # cache only, host slots (staged to the accelerator before every gather), flat gradients: bit-identical
    dict(name="host_full_flat", fcdp={"cache_device": "host", **FLAT}, grad_accum=2, steps=3, top=TOP),
    # host node buffer, last block gated off in the boundary micro-step: the flush path runs
    dict(name="host_full_node_gated", fcdp={"cache_device": "host", **NODE}, grad_accum=4, gate={3}, steps=3, top=TOP),
    dict(name="host_lora_flat", fcdp={"cache_device": "host", **FLAT}, grad_accum=2, lora_rank=2, steps=3, top=TOP),
    dict(name="device_lora_node", fcdp={"cache_device": "device", **NODE}, grad_accum=2, lora_rank=2, steps=3, top=TOP),
    dict(name="device_full_flat", fcdp={"cache_device": "device", **FLAT}, grad_accum=2, steps=3, top=TOP),
    # fcdp.param_compression: pinned host references copied to the accelerator and back on the gather stream
    dict(name="host_full_int8", fcdp={"cache_device": "host", **FLAT, "param_compression": "int8"}, grad_accum=2,
         steps=3, lossy=True, top=TOP),
    # grad_compression: host residuals (copied to the accelerator and back around each exchange), host node buffer,
    # the flush path compressed too
    # NCCL's reduce-scatter branch (the lab's grads.reduce_scatter): the node sums are a view of the stages' workspace,
    # read by the host slots' round trip on the node buffer's stream (grads/workspace.py)
    dict(name="host_full_node_rs_gated", fcdp={"cache_device": "host", **NODE, "grad_bucket_size": 256,
                                               "grad_inflight_buckets": 2}, grad_accum=2, gate={1}, steps=3, top=TOP,
         lab="grads.reduce_scatter"),
    dict(name="host_full_node_int8_gated", fcdp={"cache_device": "host", **NODE, "grad_compression": "int8"},
         grad_accum=4, gate={3}, steps=3, rtol=2e-2, weights_rtol=0.1, top=TOP),
    # issue 31: small buckets, two inter-node stages in flight behind the backward (grads/inflight.py), the flush too
    dict(name="host_full_node_buckets_gated", fcdp={"cache_device": "host", **NODE, "grad_bucket_size": 256,
                                                    "grad_inflight_buckets": 2}, grad_accum=2, gate={1}, steps=3, top=TOP),
    # issue 31, the run-ahead on streams (runtime/staged.py): stage 1 ahead on the stage-1 stream into pinned stashes,
    # copied back on the gather stream; bit-identical (the last block skipped in each window's first micro-step: its
    # group, last in the plan, is taken in the second). With the push from the step's end and a GatheredParameters
    # edit between steps, the pending groups are dropped (their events waited for, their stashes retired). With a
    # budget no group fits, every fetch's own stage 1 runs on the stage-1 stream and stage 2 waits for its event.
    dict(name="host_full_flat_ahead", fcdp={"cache_device": "host", **FLAT, "param_runahead_streams": True},
         grad_accum=2, gate={0}, steps=3, top=TOP),
    dict(name="host_full_flat_push_edit", fcdp={"cache_device": "host", **FLAT, "param_runahead_streams": True,
                                                "param_push_bytes": 2**30}, grad_accum=1, steps=3, edit="first", top=TOP),
    # a rolling push of about one group: the last weight's group is still planned when it is edited and issued after
    # the edit, its copy waiting for the edit's event (not a broken variant: DeepSpeed's GatheredParameters exit
    # leaves the host ordered after the edit's write, so the stream model cannot see the copy race it)
    dict(name="host_full_flat_roll_edit", fcdp={"cache_device": "host", **FLAT, "param_runahead_streams": True,
                                                "param_push_bytes": 9000}, grad_accum=1, steps=3, edit="last", top=TOP),
    dict(name="device_full_flat_ahead_own", fcdp={"cache_device": "device", **FLAT, "param_runahead_streams": True,
                                                  "param_runahead_bytes": 1}, grad_accum=1, steps=3, top=TOP),
]
BY_NAME = {s["name"]: s for s in SCENARIOS}
RTOL = 1e-5  # node accumulation reorders the gradient sum (tests/test_grads.py)

#: Each of FCDP's stream orderings, removed for one step of a run (``workers/device_discipline.broken_ordering``),
#: and what the stream-order model must then report: the offending access's site and the earlier one's.
SITE = r"[\w/.]+:\d+ \w+ \(position \d+\)"
ORDERINGS = {
    # the staged copy (copy stream) waits for the fill's event (releasing stream)
    "fill_ready": (r"read of pinned host memory on stream 'fcdp_param_h2d' at storage/cache.py:\d+ staged .* is "
                   r"not ordered after its write on stream 'fcdp_fill' at storage/cache.py:\d+ _fill"),
    # the two-stage gather's partition copies (issuing stream) wait for the optimizer step's event
    # (a probe on every rank after the clean steps, workers/device_discipline.py _optimizer_event_probe)
    "optimizer_event": (r"read of [\w ]+ on stream 'ds_allgather_probe' at [\w/.]+:\d+ \w+ .* is not ordered after "
                        r"its write on stream 'default' at [\w/.]+:\d+ _optimizer_event_probe"),
    # the reduce stream waits for a host residual's copy to the accelerator (residual stream)
    "residual_ready": (r"read of accelerator copy of host memory on stream 'ds_reduce_and_partition' at [\w/.]+:\d+ \w+ "
                       r".* is not ordered after its write on stream 'fcdp_grad_residual' at grads/residual.py:\d+ "
                       r"_host_to_accel"),
    # the residual stream waits for the new residual (reduce stream) before copying it to the host
    "residual_value": (r"read of [\w ]+ on stream 'fcdp_grad_residual' at grads/residual.py:\d+ write_many .* is not "
                       r"ordered after its write on stream 'ds_reduce_and_partition' at [\w/.]+:\d+ \w+"),
    # the reduce stream waits for the gradient's inter-node stage (its group's stream) before reading what it received
    # (issue 31: the stage runs behind the backward, grads/inflight.py); exact, and compressed (decoded at completion)
    "inter_node_wait": (r"read of [\w ]+ on stream 'ds_reduce_and_partition' at grads/collectives.py:\d+ total .* is "
                        r"not ordered after its write on stream 'collectives\(\d+, \d+\)'"),
    # a workspace buffer is written for the next stage only after the collective that used it completed
    # ([Note: when a buffer may be reused] in grads/workspace.py)
    # a node sum read by the node buffer's stream (host slot) is rewritten only after that stream's event
    "workspace_reader": (r"write of door accelerator memory on stream 'collectives\(\d+, \d+\)' at grads/collectives.py:\d+ "
                         r"_issue_scatter_sum .* is not ordered after its read on stream 'fcdp_grad_buffer' at "
                         r"grads/buffer.py:\d+ _round_trip"),
    "workspace_reuse": (r"write of door accelerator memory on stream 'ds_reduce_and_partition' at grads/collectives.py:\d+ "
                        r"issue_inter_node .* is not ordered after its read on stream 'collectives\(\d+, \d+\)' at "
                        r"grads/collectives.py:\d+ _issue_scatter_sum"),
    "codec_inter_node_wait": (r"read of [\w ]+ on stream 'ds_reduce_and_partition' at compress/\w+.py:\d+ \w+ .* is "
                              r"not ordered after its write on stream 'collectives\(\d+, \d+\)'"),
    # the gather stream waits for a group's stage 1 issued ahead (and its copy into the stash) before reading the stash
    "ahead_ready": (r"read of pinned host memory on stream 'fcdp_gather' at runtime/staged.py:\d+ stage2 .* is not "
                    r"ordered after its write on stream 'fcdp_stage1' at runtime/staged.py:\d+ issue"),
    # a stash is dropped only once its copy back to the accelerator is done
    "ahead_release": (r"pinned host memory dropped at runtime/staged.py:\d+ reap while its use on stream 'fcdp_gather' "
                      r"at runtime/staged.py:\d+ stage2"),
    # a fetch's own stage 2 (gather stream) waits for its stage 1 on the stage-1 stream
    "stage1_event": (r"read of [\w ]+ on stream 'collectives\(\d+, \d+\)' at runtime/staged.py:\d+ stages_on_streams .* "
                     r"is not ordered after its write on stream 'collectives\(\d+, \d+\)'"),
    # pinned chunks emptied by the move to the accelerator are dropped only once the move's copies are done
    "deferred_release": (r"pinned host memory dropped at storage/cache.py:\d+ reap while its use on stream "
                         r"'default' at storage/cache.py:\d+ move"),
}
RESIDUAL = ["residual_ready", "residual_value", "codec_inter_node_wait"]
AHEAD = ["ahead_ready", "ahead_release", "stage1_event"]
BREAKS = [{"scenario": BY_NAME["host_full_node_gated"],
           "breaks": [k for k in ORDERINGS
                      if k not in ("deferred_release", "workspace_reuse", "workspace_reader")
                      and k not in RESIDUAL + AHEAD]},
          # stages in flight behind later buckets: the next stage takes the buffers of one still in flight
          {"scenario": BY_NAME["host_full_node_buckets_gated"], "breaks": ["workspace_reuse"]},
          {"scenario": BY_NAME["host_full_node_rs_gated"], "breaks": ["workspace_reader"]},
          {"scenario": BY_NAME["device_lora_node"], "breaks": ["deferred_release"]},  # the move: end of step 2
          {"scenario": BY_NAME["host_full_node_int8_gated"], "breaks": RESIDUAL},
          {"scenario": BY_NAME["host_full_flat_ahead"], "breaks": ["ahead_ready", "ahead_release"]},
          {"scenario": BY_NAME["device_full_flat_ahead_own"], "breaks": ["stage1_event"]}]


@pytest.fixture(scope="module")
def strict():
    return run_ranks("device_discipline:strict_runs", 4, timeout=1200, scenarios=SCENARIOS, stream_breaks=BREAKS)


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
        if sc.get("gate") and sc["fcdp"].get("grad_accumulation") == "node":
            assert fcdp["stats"]["grad_flushed"] > 0  # the host-buffer flush ran
        if sc["fcdp"].get("param_runahead_streams"):  # the run-ahead on streams ran (runtime/staged.py)
            ahead = sc["fcdp"].get("param_runahead_bytes") != 1
            assert (fcdp["stats"]["param_push_used"] > 0) == ahead, fcdp["stats"]["param_push_used"]
            pushed = {k: v for k, v in fcdp["stats"].items() if k.startswith("param_push")}
            assert (pushed["param_push_cancelled"] > 0) == (sc.get("edit") == "first"), pushed  # a pending group
            assert (pushed["param_push_rolled"] > 0) == (sc.get("edit") == "last"), pushed  # about one group at once
        if sc.get("lora_rank"):
            assert fcdp["stats"]["batched_refills"] > 0  # the stale adapters' batched two-stage refill ran
        if sc.get("rtol"):  # lossy: int8 gradients across nodes
            assert fcdp["stats"]["grad_compressed_exchanges"] > 0 and fcdp["stats"]["grad_residual_host_bytes"] > 0
        if sc.get("lossy"):  # compressed reconstructions: close to ZeRO-3, not equal (tests/test_compress_params.py)
            assert fcdp["stats"]["param_compressed_gathers"] > 0 and fcdp["stats"]["param_reference_host_pool_bytes"] > 0
            for a, b in zip(plain["losses"], fcdp["losses"]):
                assert abs(a - b) <= 1e-2 * abs(a)
        elif sc["fcdp"].get("grad_accumulation") == "node":
            rtol = sc.get("rtol", RTOL)
            for a, b in zip(plain["losses"], fcdp["losses"]):
                assert abs(a - b) <= rtol * abs(a)
            for key, w in plain["weights"].items():  # lossy: Adam moves near-zero gradients by +-lr either way
                assert (fcdp["weights"][key] - w).norm() <= sc.get("weights_rtol", rtol) * w.norm(), key
        else:  # the cache alone: bit-identical
            assert fcdp["losses"] == plain["losses"]
            for key, w in plain["weights"].items():
                assert torch.equal(w, fcdp["weights"][key]), key


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_no_blocking_host_device_operation_beyond_zero3(strict, name):
    for per_rank in strict:
        assert not steady_excess(per_rank[name])


def test_stream_order_holds_in_every_scenario(strict):
    """The stream-order model raises on the first violation: every scenario above ran through (all 4 ranks), and
    so did the first (clean) step of each broken run, and the optimizer-event probe with its event."""
    for per_rank in strict:
        for spec in BREAKS:
            assert per_rank[f"broken:{spec['scenario']['name']}"]["clean"] == []
        assert per_rank["broken:host_full_node_gated"]["optimizer_event_clean"] == []


@pytest.mark.parametrize("ordering", list(ORDERINGS))
def test_removing_a_stream_ordering_is_reported_with_both_sites(strict, ordering):
    """Broken variant: the ordering removed for one step; the model names the access and the one it races."""
    for per_rank in strict:
        run = next(per_rank[f"broken:{s['scenario']['name']}"] for s in BREAKS if ordering in s["breaks"])
        assert any(re.search(ORDERINGS[ordering], m) for m in run[ordering]), run[ordering][:3]


def test_host_buffer_in_a_collective_is_refused():
    """Bug put back: the flush hands host buffer slots to the inter-node stage (NCCL would crash on them, and the copy
    into the workspace would be a host wait): refused by name where stage 2 takes its input."""
    with pytest.raises(RankFailure, match=r"HostMemoryInStage: fcdp: stage 2 was handed host memory"):
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


def test_blocking_residual_copy_is_counted():
    """Bug put back: the host residual is copied to the accelerator with the host waiting, once per parameter."""
    per_rank = run_ranks("device_discipline:strict_runs", 4, timeout=600,
                         scenarios=[{**BY_NAME["host_full_node_int8_gated"], "steps": 2}], break_kind="blocking_residual")
    problems = steady_excess(per_rank[0]["host_full_node_int8_gated"])
    assert problems and "('blocking_copy'" in problems[0] and "to_accel" in problems[0], problems


def test_strict_door_tells_host_from_accelerator():
    """In-process: the subclass survives ops, mixing raises, the door's copies cross, pageable copies are logged."""
    from fcdp_lab.strict import strict_device as sd
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


@contextmanager
def _collected():
    """The stream-order model with violations collected (in-process), the tracker on for the block."""
    from fcdp_lab.strict import strict_streams as ss
    with ss.tracking() as model:
        model.raise_errors, mark = False, len(model.violations)
        found: list[str] = []
        try:
            yield found
        finally:
            gc.collect()
            found += model.violations[mark:]
            model.raise_errors = True


def test_stream_model_reports_each_kind_with_both_sites():
    """In-process: a read on another stream before a wait, a host read of pinned memory before its copy's event,
    a free while another stream used it without record_stream; each fixed by the ordering it lacked."""
    from fcdp_lab.strict import strict_device as sd
    door = sd.StrictDoor()
    here = r"tests/test_device_discipline.py:\d+ test_stream_model_reports_each_kind_with_both_sites"
    side = door.side_stream("test")
    with _collected() as found:
        slot = door.pin_empty(8, torch.float32).zero_()
        door.to_host(torch.arange(8.0), out=slot)  # a device-to-host copy on the default stream
        filled = door.record_event()
        with door.stream(side):
            door.to_accel(slot)  # no wait: races the copy
            door.wait_event(filled)
            staged = door.to_accel(slot)  # ordered
        door.wait_event(door.current_stream().record_event())
        float(slot.sum())  # the host reads before waiting on the copy's event
        door.host_wait(filled)
        float(slot.sum())  # ordered
        door.wait_stream(side)
        staged.mul(2)  # used on the default stream, then dropped without record_stream
        del staged
    assert len(found) == 3, found
    assert re.search(rf"read of pinned host memory on stream 'fcdp_test' at {here} .* not ordered after its write on "
                     rf"stream 'default' at {here}", found[0]), found[0]
    assert re.search(rf"read of pinned host memory on stream 'host' at {here} .* not ordered after its write on stream "
                     rf"'default' at {here} .*the host must wait", found[1]), found[1]
    assert re.search(rf"accelerator copy of host memory \(allocated on stream 'fcdp_test' at {here} .*\) was freed at "
                     rf"{here} while its use on stream 'default' at {here}", found[2]), found[2]
    with _collected() as fixed:
        with door.stream(side):
            staged = door.to_accel(door.pin_empty(4, torch.float32).zero_())
        door.wait_stream(side)
        staged.mul(2)
        door.record_stream(staged)
        del staged
    assert fixed == []


def _filled_entry(door, host_wait):
    """A host cache slot filled through NodeCache (verify mode: the host checksums the slot after its fill)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from fcdp_deepspeed.reporting.stats import CacheCounters
    from fcdp_deepspeed.storage.cache import CacheEntry, NodeCache, Placement, SlotPool
    param = torch.nn.Parameter(torch.arange(8.0))
    param.ds_id, param.ds_numel, param.ds_status, param.ds_secondary_tensor = 0, 8, ZeroParamStatus.AVAILABLE, None
    cache = NodeCache(rank_in_node=0, counters=CacheCounters(), checksums=True)
    entry = cache.entries[0] = CacheEntry(param=param, name="w", slot_numel=4, start=0, dtype=torch.float32)
    with device.use(door):
        assert not SlotPool(Placement.HOST, pin=True).reserve([entry])
        door.host_wait = host_wait
        cache.on_partition(entry, has_been_updated=False)
    return entry


def test_verify_checksum_waits_for_the_fill():
    """Verify mode's host checksum reads the pinned slot: after ``host_wait(entry.ready)``, never before (broken
    variant: the host wait dropped)."""
    from fcdp_lab.strict import strict_device as sd
    door = sd.StrictDoor()
    with _collected() as found:
        entry = _filled_entry(door, door.host_wait)
    assert found == [] and entry.checksum == 0.0 + 1 + 2 + 3
    with _collected() as found:
        _filled_entry(door, lambda event: None)
    assert found and re.search(r"read of pinned host memory on stream 'host' at storage/cache.py:\d+ _fill .* "
                               r"after its write on stream 'fcdp_fill' at storage/cache.py:\d+ _fill", found[0]), found


@pytest.mark.parametrize("placement", ["host", "device"])
@pytest.mark.parametrize("broken", ["", "fill_producer", "fill_record_stream", "fill_ready"])
def test_fill_runs_on_its_stream_ordered_by_events(placement, broken):
    """In-process, through ``NodeCache.on_partition``: the gathered value is written on a producer stream the
    releasing (default) stream waits for, as DeepSpeed's consumer does; the fill copies it into a slot on the fill
    stream, then the value is freed and a reader stream reads the slot after ``entry.ready``. Each ordering of
    [Note: asynchronous fill] removed in turn is reported with both sites: the fill waits for the producer, the
    source is ``record_stream``-ed on the fill stream, the reader waits for the fill."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from fcdp_lab.strict import strict_device as sd
    from fcdp_deepspeed.reporting.stats import CacheCounters
    from fcdp_deepspeed.storage.cache import CacheEntry, NodeCache, Placement, SlotPool
    door = sd.StrictDoor()
    wait_event, record_stream = door.wait_event, door.record_stream
    on = lambda name: door.current_stream().name == name  # noqa: E731
    if broken == "fill_producer":
        door.wait_event = lambda ev: None if on("fcdp_fill") else wait_event(ev)
    elif broken == "fill_record_stream":
        door.record_stream = lambda t: None if on("fcdp_fill") else record_stream(t)
    producer, reader = door.side_stream("test_gather"), door.side_stream("test_reader")
    cache = NodeCache(rank_in_node=0, counters=CacheCounters(), checksums=False)
    param = torch.nn.Parameter(torch.zeros(0))
    param.ds_id, param.ds_numel, param.ds_status, param.ds_secondary_tensor = 0, 8, ZeroParamStatus.AVAILABLE, None
    entry = cache.entries[0] = CacheEntry(param=param, name="w", slot_numel=8, start=0, dtype=torch.float32)
    where = Placement.HOST if placement == "host" else Placement.DEVICE
    with device.use(door), _collected() as found:
        pool = SlotPool(where, pin=True)
        assert not pool.reserve([entry])
        with door.stream(producer):  # the gather: a new accelerator tensor, written on its stream
            full = torch.arange(8.0) + 1
        door.wait_stream(producer)  # the consumer (releasing stream) waits for the gather
        param.data = full
        cache.on_partition(entry, has_been_updated=False)
        if broken == "fill_ready":
            entry.ready = None
        param.data = torch.zeros(0)  # DeepSpeed frees the gathered tensor right after the partition call
        del full
        gc.collect()
        with door.stream(reader):  # the slot's first reader (a staged copy, a device slot's gather)
            door.wait_event(entry.ready)
            door.to_accel(entry.slot).sum() if placement == "host" else entry.slot.sum()
        for s in (door.side_stream("fill"), reader):
            s.synchronize()  # the host knows both are done: the pool may go
        entry.slot = None
        del pool
        gc.collect()
    here = r"tests/test_device_discipline.py:\d+ test_fill_runs_on_its_stream_ordered_by_events"
    fill = r"storage/cache.py:\d+ _fill"
    expected = {
        "": None,
        "fill_producer": rf"read of tensor on stream 'fcdp_fill' at {fill} .* not ordered after its write on stream "
                         rf"'fcdp_test_gather' at {here}",
        "fill_record_stream": rf"tensor \(allocated on stream 'fcdp_test_gather' at {here} .*\) was freed at .* while its "
                              rf"use on stream 'fcdp_fill' at {fill}",
        "fill_ready": rf"read of [\w ]+ on stream 'fcdp_test_reader' at [\w/.]+:\d+ \w+ .* not ordered after its write on "
                      rf"stream 'fcdp_fill' at {fill}",
    }[broken]
    if expected is None:
        assert found == [], found
    else:
        assert any(re.search(expected, m) for m in found), found


def test_reduction_index_is_built_on_the_gradients_device(monkeypatch):
    """``order_index`` caches per device: the tensor lives on that device, whatever the current one (broken variant:
    built on the current device, as before)."""
    from fcdp_deepspeed.grads import layout
    meta = torch.device("meta")
    monkeypatch.setattr(layout, "_ORDER_INDEX", {})
    assert layout.order_index((1, 0), meta).device == meta
    monkeypatch.setattr(layout, "_ORDER_INDEX", {})
    monkeypatch.setattr(device, "small_to_accel", lambda values, dtype, where=None: torch.tensor(values, dtype=dtype))
    assert layout.order_index((1, 0), meta).device != meta  # what the check above would catch
