"""Rank workers of test_device_discipline.py: plain ZeRO-3 and FCDP under strict device mode
(``FCDP_STRICT_DEVICE=1``), with the blocking host/accelerator operations of every optimizer step.
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
import time

import torch
import torch.nn.functional as F

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

import fcdp_deepspeed
from fcdp_deepspeed import grads
from fcdp_deepspeed.runtime.compression_reference import ReferenceStore
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.runtime.staged import StreamAhead
from fcdp_deepspeed.storage.cache import NodeCache
from fcdp_lab import strict
from fcdp_lab.harness import toy
from fcdp_lab import sabotage as lab_sabotage
from fcdp_lab.strict import strict_device, strict_streams
from workers import grads as grad_workers
from workers.common import setup

_FLUSHING = threading.local()


def sabotage(kind: str) -> None:
    """Deliberately broken variants: the CUDA-path bugs put back."""
    if kind == "host_flush":  # the flush hands host buffer slots to the inter-node collective
        original_flush, original_take = grads.GradReducer.flush, grads.NodeGradBuffer.take

        def flush(self, *args, **kwargs):
            _FLUSHING.on = True
            try:
                yield from original_flush(self, *args, **kwargs)
            finally:
                _FLUSHING.on = False

        def take(self, ds_id, shape):
            if getattr(_FLUSHING, "on", False):
                self.dirty.discard(ds_id)
                return self.slot(ds_id).view(shape)
            return original_take(self, ds_id, shape)

        grads.GradReducer.flush, grads.NodeGradBuffer.take = flush, take
    elif kind == "blocking_fill":  # the fill waits for its copy on the host, as before the door
        original_fill = NodeCache._fill

        def _fill(self, entry, refresh, taken):
            original_fill(self, entry, refresh, taken)
            device.current_stream().synchronize()

        NodeCache._fill = _fill
    elif kind == "blocking_reference":  # the new reference's copy into pinned memory waited for on the host
        original_write = ReferenceStore.write_many

        def write_many(self, refs, values, *, lossy):
            original_write(self, refs, values, lossy=lossy)
            for ref in refs:
                device.host_wait(ref.ready)

        ReferenceStore.write_many = write_many
    elif kind == "index_per_bucket":  # the reduction's permutation index built from a list on every bucket
        grads.layout.order_index = lambda order, where: torch.tensor(list(grads.layout.slot_positions(tuple(order))),
                                                                     dtype=torch.long, device=where)
    elif kind == "blocking_residual":  # the host residual read with the host waiting for its copy
        from fcdp_deepspeed.grads import residual
        original_to_accel = residual.device.to_accel

        class _Blocking:
            def __getattr__(self, name):
                return getattr(device, name)

            @staticmethod
            def to_accel(t, out=None, *, non_blocking=True):
                return original_to_accel(t, out, non_blocking=False)

        residual.device = _Blocking()
    elif kind:
        raise ValueError(kind)


def _run(sc: dict, fcdp: bool) -> dict:
    with lab_sabotage.applied(sc.get("lab", "")):  # a lab variant for the whole run (e.g. NCCL's reduce-scatter branch)
        return _run_scenario(sc, fcdp)


def _run_scenario(sc: dict, fcdp: bool) -> dict:
    cpu = time.process_time()
    strict_streams.MODEL.enabled = fcdp and os.environ.get("FCDP_TEST_TRACK", "1") == "1"  # the plain run: sync baseline only
    block = {"enabled": True, "ranks_per_node": 2, **sc.get("fcdp", {})} if fcdp else None
    engine = grad_workers.build(sc, grad_workers._config(sc, block))
    ga, hidden = engine.gradient_accumulation_steps(), sc.get("hidden", 32)
    losses, per_step = [], []
    micro = 0
    with strict_device.counting() as log:
        for _ in range(sc.get("steps", 3)):
            mark = log.mark()
            for _ in range(ga):
                x, y = toy.batch(micro, engine.train_micro_batch_size_per_gpu(), hidden)
                loss = F.mse_loss(engine(x, **grad_workers.gate(sc, micro)), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach().clone())
                micro += 1
            per_step.append([(e.kind, e.owner, e.site) for e in log.since(mark)])
            if sc.get("edit"):  # a GatheredParameters edit between steps (the same values): an invalidation event
                _edit_weight(engine, sc["edit"])
    weights = toy.gather_weights(engine)
    return {"losses": [float(v) for v in losses], "weights": weights if dist.get_rank() == 0 else {},
            "syncs": per_step, "stats": fcdp_deepspeed.get_stats(engine), "door": type(device.current()).__name__,
            "optimizer": type(engine.optimizer).__name__, "cpu_seconds": time.process_time() - cpu}


def _edit_weight(engine, which: str) -> None:
    """``GatheredParameters`` with a modifier rank on the ``which`` ("first" or "last") weight, unchanged values:
    DeepSpeed re-partitions it with ``has_been_updated`` (the run-ahead drops what holds it, ``runtime/runahead.py``),
    in ZeRO-3 and FCDP alike."""
    import deepspeed
    weights = [p for p in engine.module.parameters() if len(p.ds_shape) == 2]
    weight = weights[0] if which == "first" else weights[-1]
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        if dist.get_rank() == 0:
            weight.data.mul_(1.0)


def strict_runs(scenarios: list[dict], break_kind: str = "", stream_breaks: list[dict] = ()) -> dict:
    """Each scenario with plain ZeRO-3 and with FCDP, in strict device mode; then, for each of
    ``stream_breaks`` (``{"scenario": ..., "breaks": [...]}``), one FCDP run whose step i + 1 removes ordering
    ``breaks[i]`` (:func:`broken_ordering`), with stream-order violations collected per step instead of raised."""
    os.environ[strict.ENV] = "1"
    strict.install()  # every engine built from here on: the strict door, the collectives guarded
    setup(2)
    sabotage(break_kind)
    out = {sc["name"]: {mode: _run(sc, mode == "fcdp") for mode in ("plain", "fcdp")} for sc in scenarios}
    for spec in stream_breaks:
        out[f"broken:{spec['scenario']['name']}"] = _run_broken(spec["scenario"], spec["breaks"])
    return out


# -- stream orderings removed one at a time (the stream-order model must name each) ----------------------
class _Patches:
    """Attributes replaced for one step, restored after."""

    def __init__(self) -> None:
        self.saved: list[tuple] = []
        self.contexts = contextlib.ExitStack()

    def enter(self, context) -> None:
        """A context (a lab variant applied: ``fcdp_lab.sabotage``), left at :meth:`undo`."""
        self.contexts.enter_context(context)

    def set(self, obj, name: str, value) -> None:
        self.saved.append((obj, name, obj.__dict__[name] if name in obj.__dict__ else _MISSING))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, old in reversed(self.saved):
            delattr(obj, name) if old is _MISSING else setattr(obj, name, old)
        self.saved.clear()
        self.contexts.close()


_MISSING = object()


def _stream_named(name: str):
    return strict_streams.MODEL.current().name == name


def broken_ordering(kind: str, patches: _Patches) -> None:
    """Remove one of FCDP's stream orderings (the door of this process is the strict door)."""
    door = device.current()
    wait_event, wait_stream, record_stream = door.wait_event, door.wait_stream, door.record_stream
    origin = lambda ev: getattr(getattr(ev, "stream", None), "name", "")  # noqa: E731
    if kind == "fill_ready":  # fills record no event: nothing waits for the copy into the slot
        original = NodeCache._fill

        def _fill(self, entry, refresh, taken):
            original(self, entry, refresh, taken)
            entry.ready = None

        patches.set(NodeCache, "_fill", _fill)
    elif kind == "fill_producer":  # the fill stream does not wait for the releasing stream (the gathered values)
        patches.set(door, "wait_event", lambda ev: None if _stream_named("fcdp_fill") else wait_event(ev))
    elif kind == "fill_record_stream":  # the gathered source freed without record_stream on the fill stream
        patches.set(door, "record_stream", lambda t: None if _stream_named("fcdp_fill") else record_stream(t))
    elif kind == "residual_ready":  # the reduce stream does not wait for a residual's copy to the accelerator
        patches.set(door, "wait_event", lambda ev: None if origin(ev) == "fcdp_grad_residual" and not _stream_named(
            "fcdp_grad_residual") else wait_event(ev))
    elif kind == "residual_value":  # the residual stream does not wait for the new residual (reduce stream)
        patches.set(door, "wait_event", lambda ev: None if _stream_named("fcdp_grad_residual") else wait_event(ev))
    elif kind == "staged_event":  # the all-gather stream does not wait for the staged copies
        patches.set(door, "wait_event", lambda ev: None if origin(ev) == "fcdp_param_h2d" and not _stream_named(
            "fcdp_param_h2d") else wait_event(ev))
    elif kind == "staged_record_stream":  # staged copies dropped without record_stream on the all-gather stream
        patches.set(door, "record_stream", lambda t: None if _stream_named("ds_allgather") else record_stream(t))
    elif kind == "flush_wait":  # the step's stream does not wait for the flush on the reduce stream
        patches.set(door, "wait_stream", lambda st: None if getattr(st, "name", "") == "ds_reduce_and_partition"
                    else wait_stream(st))
    elif kind == "grad_buffer_sums":  # the buffer's stream does not wait for the node sums
        patches.set(door, "wait_event", lambda ev: None if _stream_named("fcdp_grad_buffer") else wait_event(ev))
    elif kind == "grad_buffer_done":  # take() does not wait for the slot's round trip
        patches.set(door, "wait_event", lambda ev: None if origin(ev) == "fcdp_grad_buffer" and not _stream_named(
            "fcdp_grad_buffer") else wait_event(ev))
    elif kind == "grad_buffer_record_stream":  # the node sums dropped without record_stream on the buffer's stream
        patches.set(door, "record_stream", lambda t: None if _stream_named("fcdp_grad_buffer") else record_stream(t))
    elif kind == "two_stage_gather":  # stage 2 is not ordered after stage 1 (the peer group's all-gather)
        patches.set(strict_streams.FakeStream, "wait_event", _stage1_not_ordered)
    elif kind in ("inter_node_wait", "codec_inter_node_wait"):  # completion reads before waiting for the collective
        patches.enter(lab_sabotage.applied("grads.read_early"))
    elif kind == "workspace_reuse":  # a stage's workspace buffers given back at issue (grads/workspace.py)
        patches.enter(lab_sabotage.applied("grads.workspace_early"))
    elif kind == "workspace_reader":  # node sums given back without the node buffer stream's event (host slots)
        from fcdp_deepspeed.grads.inflight import Inflight
        release = Inflight.release
        patches.set(Inflight, "release", lambda self, after=None: release(self))
    elif kind == "ahead_ready":  # the gather stream reads a stash without waiting for its stage 1 (staged.py)
        patches.set(StreamAhead, "stash_ready", staticmethod(lambda staged: None))
    elif kind == "ahead_release":  # stashes dropped without asking their copy's event
        patches.set(door, "event_done", lambda ev: True)
    elif kind == "stage1_event":  # a fetch's stage 2 does not wait for its stage 1 on the stage-1 stream
        patches.set(door, "wait_event", lambda ev: None if origin(ev) == "fcdp_stage1" and _stream_named("fcdp_gather")
                    else wait_event(ev))
    elif kind == "deferred_release":  # emptied pinned chunks dropped without asking the move's event
        patches.set(door, "event_done", lambda ev: True)
    else:
        raise ValueError(kind)


def _stage1_not_ordered(stream, event) -> None:
    """The gather stream does not wait for a collective over one rank per node (the two-stage gather's stage 1,
    ``async_op=False`` on the engine's gather stream, [Note: streams] in runtime/gather.py): gloo finishes (values
    stay right) but stage 2, issued next from that stream, is not ordered after stage 1, what an
    ``async_op=True`` stage 1 nobody waits on does on NCCL."""
    ranks = getattr(getattr(event, "stream", None), "ranks", ())
    if stream.fcdp and len(ranks) > 1 and len({r // 2 for r in ranks}) == len(ranks):  # 2 ranks per node
        return None
    return _ORIGINAL_WAIT_EVENT(stream, event)


_ORIGINAL_WAIT_EVENT = strict_streams.FakeStream.wait_event


def _optimizer_event_probe(engine, broken: bool) -> list[str]:
    """[Note: the optimizer's writes] in-process on every rank, right after a step: the optimizer's kind of write
    to one parameter's ``ds_tensor`` on the default stream, then the step-end event (``FCDPRuntime.on_step_end``;
    ``broken``: none), then FCDP's two-stage gather of that miss issued from an all-gather stream, with no host
    wait between (in the training runs, host reads at the step's end order the two anyway). Violations found."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    model = strict_streams.MODEL
    runtime = engine.optimizer.fcdp
    param = next(p for p in engine.module.parameters()
                 if p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.ds_secondary_tensor is None and p.requires_grad)
    mark = len(model.violations)
    param.ds_tensor.data.mul_(1.0)  # the optimizer's write of the partition (same values), on the default stream
    runtime.gather.stepped = None if broken else device.record_event()
    issuing = model.new_stream("ds_allgather_probe")
    with model.on(issuing):
        handle = runtime.gather.issue([param])
        handle.wait()
    device.wait_stream(issuing)
    param.partition(has_been_updated=False)  # released as after a fetch (the release hook fills its slot)
    gc.collect()
    get_accelerator().synchronize()
    return model.violations[mark:]


def _run_broken(sc: dict, breaks: list[str]) -> dict:
    """One FCDP run of ``sc``: step 1 clean, step i + 2 without ordering ``breaks[i]``; violations per step."""
    with lab_sabotage.applied(sc.get("lab", "")):
        return _run_broken_scenario(sc, breaks)


def _run_broken_scenario(sc: dict, breaks: list[str]) -> dict:
    model = strict_streams.MODEL
    model.enabled, model.raise_errors = True, False
    block = {"enabled": True, "ranks_per_node": 2, **sc.get("fcdp", {})}
    engine = grad_workers.build(sc, grad_workers._config(sc, block))
    patches, found, micro = _Patches(), {}, 0
    try:
        for kind in ["clean"] + list(breaks):
            mark = len(model.violations)
            if kind == "optimizer_event":  # a probe after the clean steps, not a step of its own
                found["optimizer_event_clean"] = _optimizer_event_probe(engine, broken=False)
                found[kind] = _optimizer_event_probe(engine, broken=True)
                continue
            if kind != "clean":
                broken_ordering(kind, patches)
            try:
                for _ in range(engine.gradient_accumulation_steps()):
                    x, y = toy.batch(micro, engine.train_micro_batch_size_per_gpu(), sc.get("hidden", 32))
                    engine.backward(F.mse_loss(engine(x, **grad_workers.gate(sc, micro)), y))
                    engine.step()
                    micro += 1
            finally:
                patches.undo()
            gc.collect()  # frees run their checks now, inside this step
            found[kind] = model.violations[mark:]
            get_accelerator().synchronize()  # the host waits for every stream: nothing of this step lingers
    finally:
        model.raise_errors = True
    return found
