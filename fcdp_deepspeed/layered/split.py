"""A layer call over the batch as ``chunks`` calls over its parts, and their outputs as one.

[Note: what is the batch] A layer's arguments mix per-example tensors (hidden states ``(B, ...)``, masks ``(B, 1, S,
S)``, position ids ``(B, S)``) with shared ones (rotary tables of batch 1, ``cache_position`` ``(S,)``, flags). A
tensor is split when it has at least two dimensions and its first is the batch size ``B`` of the call's first
tensor; everything else is handed whole to every chunk. A 1-D tensor is never split: ``(S,)`` with ``S == B`` would
otherwise be cut wrongly, and a layer's per-example tensors carry at least a feature dimension.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


class LayeredCallError(RuntimeError):
    """A layer call that layered accumulation cannot split or merge; the message names ``fcdp.layered`` and the fix."""


def first_batch_size(args: Sequence[Any], kwargs: dict) -> int:
    """``B``: the first dimension of the call's first tensor of at least two dimensions (the layer's input)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0]
    raise LayeredCallError("fcdp.layered: a layer was called without a batched tensor (at least two dimensions), so "
                           "there is nothing to split. Fix: point fcdp.layered.layers at the module list whose entries "
                           "take the hidden states.")


def _split(value: Any, batch: int, chunks: int) -> list[Any]:
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == batch:
            return list(torch.tensor_split(value, chunks, dim=0))
        return [value] * chunks
    if isinstance(value, (tuple, list)):
        parts = [_split(v, batch, chunks) for v in value]
        return [_rebuild(value, [p[i] for p in parts]) for i in range(chunks)]
    if isinstance(value, dict):
        parts = {k: _split(v, batch, chunks) for k, v in value.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(chunks)]
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return [value] * chunks
    raise LayeredCallError(f"fcdp.layered: a layer argument of type {type(value).__name__} is neither a tensor nor a "
                           f"plain value, so it cannot be split over the batch's chunks or shared by them safely (a "
                           f"key/value cache would mix them). Fix: train without it (Hugging Face: use_cache=False), or "
                           f"remove fcdp.layered.")


def _rebuild(like: Any, items: list) -> Any:
    """A tuple or list (a named tuple too) of ``like``'s type holding ``items``."""
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)


def split_call(args: tuple, kwargs: dict, chunks: int) -> list[tuple[tuple, dict]]:
    """The call's arguments for each chunk, in order (``torch.tensor_split``: sizes differ by at most one; a batch
    smaller than ``chunks`` runs one example per chunk)."""
    batch = first_batch_size(args, kwargs)
    chunks = min(chunks, batch)  # a short last batch (a data loader that keeps it) runs in fewer chunks
    arg_parts = _split(tuple(args), batch, chunks)
    kwarg_parts = _split(dict(kwargs), batch, chunks)
    return list(zip(arg_parts, kwarg_parts))


def merge(outputs: list[Any], sizes: list[int]) -> Any:
    """The chunks' outputs as the whole batch's (``sizes``: each chunk's examples): per-example tensors (first
    dimension the chunk's size) concatenated along the batch, structures element-wise."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if all(o.dim() >= 1 and o.shape[0] == n for o, n in zip(outputs, sizes)):
            return torch.cat(outputs, dim=0)
        raise LayeredCallError(f"fcdp.layered: a layer returned a tensor of shape {tuple(first.shape)} whose first "
                               f"dimension is not its chunk's {sizes[0]} examples (an auxiliary loss, a shared bias?), "
                               f"so the chunks' values cannot be joined into the batch's. Fix: return it from the model, "
                               f"not the layer, or remove fcdp.layered.")
    if isinstance(first, (tuple, list)):
        return _rebuild(first, [merge([o[i] for o in outputs], sizes) for i in range(len(first))])
    if isinstance(first, dict):
        return type(first)((k, merge([o[k] for o in outputs], sizes)) for k in first)
    if all(o is first for o in outputs) or all(o == first for o in outputs):
        return first
    raise LayeredCallError(f"fcdp.layered: the chunks of a layer returned different {type(first).__name__} values "
                           f"that cannot be joined. Fix: remove fcdp.layered for this model.")
