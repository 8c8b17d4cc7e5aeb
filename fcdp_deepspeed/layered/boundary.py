"""Layer boundaries in host memory until the backward (``fcdp.layered.boundary_budget``).

[Note: host boundaries] A layered step keeps every layer's input for the whole batch until the backward: the inputs
each (layer, chunk) checkpoint saves for its recomputation. Non-reentrant checkpointing saves its positional tensor
inputs as saved tensors (``torch.utils.checkpoint``'s ``save_inputs``, before its own hooks are pushed), so the
saved-tensor hooks current when it is called pack them once in forward and unpack them once when the backward
recomputes the chunk (checked on the installed torch: ``tests/test_layered.py``). Past the budget, the chunk's
checkpoint is called under :func:`to_host`'s hooks: pack copies an accelerator input into pinned host memory through
the device door (on the current stream, an event recorded after it) and drops the accelerator copy (nothing else holds
it once the layer returned); unpack waits for that event on the recomputing stream and copies it back. The gradient
does not move: saved tensors are values, the graph's edges are unchanged. Keyword tensors (masks, rotary tables,
shared by every layer) are not saved that way and stay; a positional tensor already in host memory is kept as it is.

[Note: deferred release] The pinned copy is read by a non-blocking copy queued on a stream; with
``DS_PIN_MEMORY_BACKEND=native`` pinned memory is freed with no event, so each copy is retired with the event after
its copy back and dropped (``device.drop_host``) only once that event is done, as ``storage/cache.py`` does.
"""
from __future__ import annotations

import threading
from typing import Any, ContextManager, Optional

import torch

from fcdp_deepspeed.machine import device

_RETIRED: list[tuple[torch.Tensor, Any]] = []
_LOCK = threading.Lock()  # pack runs on the forward's thread, unpack on autograd's


def _reap() -> None:
    with _LOCK:
        done, _RETIRED[:] = device.split_done(_RETIRED)
    for t in done:
        device.drop_host(t)


def _pack(t: torch.Tensor) -> tuple[torch.Tensor, Any, Optional[torch.Size]]:
    if device.current().is_host(t):
        return t, None, None  # already host memory: nothing to move (``shape`` None marks it)
    _reap()
    host = device.pin_empty(t.numel(), t.dtype)
    device.to_host(t.reshape(-1), out=host)
    return host, device.record_event(), t.shape


def _unpack(saved: tuple[torch.Tensor, Any, Optional[torch.Size]]) -> torch.Tensor:
    host, event, shape = saved
    if shape is None:
        return host
    if event is not None:  # None on an accelerator without streams
        device.wait_event(event)
    out = device.to_accel(host).view(shape)
    event = device.record_event()
    if event is not None:
        with _LOCK:
            _RETIRED.append((host, event))
    return out


def to_host() -> ContextManager:
    """The saved-tensor hooks under which a chunk's checkpoint keeps its inputs in host memory."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
