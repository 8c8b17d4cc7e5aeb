"""Layer boundaries in host memory until the backward (``fcdp.layered.boundary_budget``).

[Note: host boundaries] A layered step keeps every layer's input for the whole batch until the backward: the inputs
each (layer, chunk) checkpoint saves for its recomputation. Non-reentrant checkpointing saves its positional tensor
inputs as saved tensors (``torch.utils.checkpoint``'s ``save_inputs``), so the saved-tensor hooks current when it is
called pack them once in forward and unpack them once when the backward recomputes the chunk (checked on the
installed torch: ``tests/test_layered.py``). Past the budget, the chunk's checkpoint is called under
:func:`to_host`'s hooks: pack copies the input into pinned host memory through the device door (on the current
stream, an event recorded after it) and drops the accelerator copy (nothing else holds it once the layer returned),
unpack waits for that event on the recomputing stream and copies it back. The gradient does not move: saved tensors
are values, the graph's edges are unchanged. Keyword tensors (masks, rotary tables) are not saved that way and stay
on the accelerator (they are shared by every layer).
"""
from __future__ import annotations

from typing import Any, ContextManager

import torch

from fcdp_deepspeed.machine import device


def _pack(t: torch.Tensor) -> tuple[torch.Tensor, Any, torch.Size]:
    host = device.pin_empty(t.numel(), t.dtype)
    device.to_host(t.reshape(-1), out=host)
    return host, device.record_event(), t.shape


def _unpack(saved: tuple[torch.Tensor, Any, torch.Size]) -> torch.Tensor:
    host, event, shape = saved
    if event is not None:
        device.wait_event(event)
    return device.to_accel(host).view(shape)


def to_host() -> ContextManager:
    """The saved-tensor hooks under which a chunk's checkpoint keeps its inputs in host memory."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
