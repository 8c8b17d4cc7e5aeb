"""Activation memory measured on the CPU: the bytes of live tensors a forward and backward create, tracked at dispatch.

``LiveBytes`` is a ``TorchDispatchMode`` that counts every storage an operator returns once, and subtracts it when the
storage is freed (a ``weakref.finalize`` on the storage): what the caching allocator's ``memory_allocated`` reports on
an accelerator, for the tensors created under the mode. Parameters and buffers are not counted (a view such as ``t()``
returns their storage); their gradients are (they are created in the backward).

``measure`` runs one training step's forward and backward of a plain PyTorch model (no DeepSpeed: activation memory
does not depend on how parameters are gathered) and reads the live bytes after each layer's forward: the slope over
the layers is what each layer keeps for the backward (``fcdp plan``'s boundary figure under ``fcdp.layered``).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages created under the mode, and their peak."""

    def __init__(self, existing: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        #: Storages not to count: those of ``existing`` (parameters, buffers), which views such as ``t()`` return.
        self._seen: set[int] = {t.untyped_storage().data_ptr() for t in existing}

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    nbytes = storage.nbytes()
                    self.live += nbytes
                    weakref.finalize(storage, self._free, key, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def measure(model: torch.nn.Module, layers: Sequence[torch.nn.Module], step: Callable[[], Any]) -> dict:
    """Live bytes after each layer's forward and the peak of one ``step()`` (a forward and a backward of ``model``)."""
    marks: list[int] = []
    tracker = LiveBytes([*model.parameters(), *model.buffers()])
    handles = [layer.register_forward_hook(lambda m, a, o: marks.append(tracker.live)) for layer in layers]
    try:
        with tracker:
            step()
    finally:
        for h in handles:
            h.remove()
    marks = marks[:len(layers)]  # the forward's marks (a recomputation in backward would add more)
    slope = (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else 0.0
    return {"per_layer_bytes": slope, "after_layers_bytes": marks[-1] if marks else 0, "peak_bytes": tracker.peak}
