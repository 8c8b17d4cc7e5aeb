"""Rank workers of test_device_discipline.py: plain ZeRO-3 and FCDP under strict device mode
(``FCDP_STRICT_DEVICE=1``), with the blocking host/accelerator operations of every optimizer step.
"""
from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_deepspeed import device, grads, strict_device
from fcdp_deepspeed.cache import NodeCache
from fcdp_deepspeed.compress.reference import ReferenceStore
from fcdp_deepspeed.tools import toy
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

        def _fill(self, entry, refresh):
            original_fill(self, entry, refresh)
            device.current_stream().synchronize()

        NodeCache._fill = _fill
    elif kind == "blocking_reference":  # the new reference's copy into pinned memory waited for on the host
        original_write = ReferenceStore.write

        def write(self, ref, values, *, lossy):
            original_write(self, ref, values, lossy=lossy)
            device.host_wait(ref.ready)

        ReferenceStore.write = write
    elif kind == "index_per_bucket":  # the reduction's permutation index built from a list on every bucket
        grads.layout.order_index = lambda order, where: torch.tensor(list(order), dtype=torch.long, device=where)
    elif kind:
        raise ValueError(kind)


def _run(sc: dict, fcdp: bool) -> dict:
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
    weights = toy.gather_weights(engine)
    return {"losses": [float(v) for v in losses], "weights": weights if dist.get_rank() == 0 else {},
            "syncs": per_step, "stats": fcdp_deepspeed.get_stats(engine), "door": type(device.current()).__name__,
            "optimizer": type(engine.optimizer).__name__}


def strict_runs(scenarios: list[dict], break_kind: str = "") -> dict:
    """Each scenario with plain ZeRO-3 and with FCDP, in strict device mode."""
    os.environ[strict_device.ENV] = "1"  # read when each engine is built
    setup(2)
    sabotage(break_kind)
    return {sc["name"]: {mode: _run(sc, mode == "fcdp") for mode in ("plain", "fcdp")} for sc in scenarios}
