"""Layered (breadth-first) gradient accumulation over a model's layers (``fcdp.layered``).

Each batch runs through a layer as ``chunks`` calls, one per chunk, each under non-reentrant activation
checkpointing, before the next layer starts; the layer's output is the chunks' outputs joined. What that does:

- **Forward**: every chunk passes layer ``i`` before any chunk enters layer ``i+1`` (the loop is inside the layer).
- **Backward**: autograd runs ready nodes in decreasing sequence number, and all of layer ``i``'s chunk graphs were
  recorded after layer ``i-1``'s, so the backward recomputes and differentiates layer ``i`` for every chunk before
  it reaches layer ``i-1`` (checked on the installed torch by ``tests/test_layered.py``). A parameter used by every
  chunk has its gradients summed in its ``AccumulateGrad`` input buffer: its gradient hook fires once per step, so
  ZeRO-3 (or FCDP's reducer) reduces it once, as soon as the backward leaves the layer.
- **One gather per layer per pass** ([Note: the hold is ZeRO-3's leaf module]): each layer is made a ZeRO-3 leaf
  module (``deepspeed.utils.set_z3_leaf_module``, DeepSpeed's own mechanism for modules whose inside it must not
  hook): DeepSpeed then fetches all of the layer's parameters in the layer's pre-forward hook, releases them in its
  post-forward hook, fetches them again when the gradient reaches the layer's output and releases them when it
  leaves through the layer's input. The chunk loop and every recomputation run between those hooks, so the layer is
  gathered once in forward and once in backward whatever ``chunks`` is, and every copy is DeepSpeed's (or FCDP's
  cache's) fetch of the step's parameters: nothing here holds a parameter across a write.
- **Memory**: the layer boundaries of the whole batch stay alive (the checkpoints' inputs), the inside of a layer
  for one chunk at a time: full-batch training with per-layer checkpointing.

Only training calls with gradients split (``module.training`` and grad mode); evaluation and generation run the
layer whole, as written.
"""
from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from deepspeed.utils import set_z3_leaf_module

from fcdp_deepspeed.config.layered import LayeredConfig
from fcdp_deepspeed.layered import boundary, split
from fcdp_deepspeed.layered.layers import find_layers

_ATTACHED = "_fcdp_layered"


@dataclass
class LayeredCounters:
    """What ran layered (``get_stats``' ``layered_*``)."""

    batches: int = 0
    """Training batches that passed the first layer in chunks."""
    chunk_calls: int = 0
    """Chunk forwards of all layers (``batches * layers * chunks`` when nothing ran whole)."""
    recomputes: int = 0
    """Chunk recomputations in backward (the same count once each batch's backward ran)."""
    boundary_bytes: int = 0
    """Bytes of the layer inputs the last batch kept for its backward (every layer's, all chunks)."""
    peak_boundary_bytes: int = 0
    """The largest ``boundary_bytes`` of any batch."""
    host_boundary_bytes: int = 0
    """Of the last batch's boundaries, the bytes kept in host memory (``boundary_budget``)."""


class LayeredStack:
    """A model's layer list run layered: the chunk loop installed as each layer's ``forward``."""

    def __init__(self, model: torch.nn.Module, config: LayeredConfig, micro_batch: Optional[int] = None) -> None:
        self.chunks = config.chunks
        #: DeepSpeed's ``train_micro_batch_size_per_gpu`` (``None``: not known): a layer input whose first dimension
        #: exceeds it is not batch-first ([Note: batch first]).
        self.micro_batch = micro_batch
        self.boundary_budget = config.boundary_budget
        self.name, self.layers = find_layers(model, config.layers)
        self.counters = LayeredCounters()
        #: [Note: no key/value cache] a Hugging Face model builds a cache when ``config.use_cache`` is on, in training
        #: too, and hands it to every layer; the chunks of a batch would append to one cache. Training needs none.
        self.cache_turned_off = getattr(getattr(model, "config", None), "use_cache", False) is True
        if self.cache_turned_off:
            model.config.use_cache = False
        self._batch_bytes = 0
        #: The tensors counted in this batch's boundary bytes (id -> weak reference), reset at the first layer.
        self._seen: dict = {}
        #: Inside the chunk loop's forward (a chunk call outside it, with gradients, is a recomputation).
        self._in_forward = False
        for earlier in {id(e): e for e in (getattr(layer, _ATTACHED, None) for layer in self.layers) if e}.values():
            if len(earlier.layers) != len(self.layers) or any(a is not b for a, b in zip(earlier.layers, self.layers)):
                raise split.LayeredCallError(
                    f"fcdp.layered: {self.name} of this model is layered already by another engine over a different "
                    f"layer list ({earlier.name}, {len(earlier.layers)} layers): one model, one layer list. Fix: give "
                    f"every engine over this model the same fcdp.layered.layers, or build the engine over a fresh "
                    f"model.")  # checked before any layer changes: a refused stack leaves the model as it was
        for index, layer in enumerate(self.layers):
            if getattr(layer, _ATTACHED, None) is None:
                self._attach(index, layer)
            # [Note: the newest stack] A layer's chunk loop is installed once and runs for the stack attached last:
            # a second engine built over the same model counts its own batches with its own chunks and budget.
            setattr(layer, _ATTACHED, self)

    def _attach(self, index: int, layer: torch.nn.Module) -> None:
        nested = _nested_leaves(layer)
        if nested:
            # [Note: nested leaves] DeepSpeed marks mixture-of-experts blocks as leaves so that an expert no token
            # reached still reduces a zero gradient on every rank (its leaf gradient hook); a layered layer would
            # take those parameters into its own leaf and the per-parameter hooks, where a rank whose expert got
            # no tokens would skip the reduce its peers run.
            raise split.LayeredCallError(
                f"fcdp.layered: layer {index} of {self.name} ({type(layer).__name__}) contains ZeRO-3 leaf modules "
                f"({', '.join(nested[:3])}; mixture-of-experts blocks are leaves by DeepSpeed's default), which "
                f"layered accumulation does not run yet. Fix: remove fcdp.layered for this model.")
        if not getattr(layer, "_z3_leaf", False):
            set_z3_leaf_module(layer, True)  # before DeepSpeed registers its hooks (see the module docstring)
            layer._fcdp_layered_leaf = True  # a layer the user made a leaf keeps DeepSpeed's leaf gradients
        layer.forward = _chunked(layer, layer.forward)

    def run(self, layer: torch.nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One call of ``layer`` (its original ``forward``): in chunks when training with gradients."""
        if layer.training:
            _refuse_reentrant_checkpointing(layer)
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        self._refuse_sequence_first(split.first_batch_size(args, kwargs))
        parts = split.split_call(args, kwargs, self.chunks)
        c = self.counters
        if layer is self.layers[0]:
            c.batches += 1
            self._batch_bytes, c.host_boundary_bytes, self._seen = 0, 0, {}
        # each tensor counted once per batch (a mask or rotary table every layer receives, once)
        layer_bytes = _tensor_bytes((args, kwargs), self._seen)
        on_host = self.boundary_budget is not None and \
            self._batch_bytes - c.host_boundary_bytes + layer_bytes > self.boundary_budget
        self._batch_bytes += layer_bytes
        if on_host:  # what the hooks pack: each chunk's positional tensors (a shared one once per chunk)
            c.host_boundary_bytes += sum(_tensor_bytes(a) for a, _ in parts)
        c.boundary_bytes = self._batch_bytes
        c.peak_boundary_bytes = max(c.peak_boundary_bytes, self._batch_bytes)

        def run_chunk(*chunk_args: Any, **chunk_kwargs: Any) -> Any:
            if torch.is_grad_enabled() and not self._in_forward:
                c.recomputes += 1  # non-reentrant checkpoint's recomputation, inside the backward
            return forward(*chunk_args, **chunk_kwargs)

        outputs = []
        self._in_forward = True
        try:
            for part_args, part_kwargs in parts:
                with boundary.to_host() if on_host else nullcontext():
                    outputs.append(checkpoint(run_chunk, *part_args, use_reentrant=False, **part_kwargs))
                c.chunk_calls += 1
        finally:
            self._in_forward = False
        return split.merge(outputs, [split.first_batch_size(a, k) for a, k in parts])

    def _refuse_sequence_first(self, batch: int) -> None:
        """[Note: batch first] The chunks split a layer input's first dimension. Megatron-DeepSpeed's GPT (and other
        sequence-first stacks) pass hidden states as ``(S, B, H)``: split there, attention would see a part of each
        sequence and the values would change without an error. A training input's first dimension larger than the
        micro-batch DeepSpeed was configured with cannot be the batch, so it is refused by name."""
        if self.micro_batch and batch > self.micro_batch:
            raise split.LayeredCallError(
                f"fcdp.layered: a layer of {self.name} got an input whose first dimension is {batch}, more than the "
                f"{self.micro_batch} examples of a micro-batch (train_micro_batch_size_per_gpu): its layers take the "
                f"sequence (or another dimension) first, as Megatron-DeepSpeed's GPT does, and layered accumulation "
                f"splits the first dimension. Fix: remove fcdp.layered for this model, or raise "
                f"train_micro_batch_size_per_gpu to the batch the model is fed.")

    def keep_parameter_gradients(self) -> None:
        """After DeepSpeed registered its module hooks: the layers' parameters keep the per-parameter gradient hook.

        [Note: leaf fetches, per-parameter gradients] DeepSpeed marks every parameter of a leaf module
        (``param.ds_z3_leaf_module``) and then reduces their gradients from the module's full backward hook instead
        of each parameter's ``AccumulateGrad`` hook. That hook fires when the gradient reaches the layer's input, and
        when the input needs no gradient (the first layers of a LoRA model) autograd fires it before the layer's own
        backward: DeepSpeed then reduces zeros and the parameters are partitioned under the layer's backward. The
        leaf is wanted for the fetch only (``partitioned_param_coordinator`` reads the module flag, never the
        parameter mark), so the mark is taken off again before the optimizer creates its gradient hooks: each
        parameter is reduced once, after its gradient is complete, as in any ZeRO-3 model."""
        for layer in self.layers:
            if not getattr(layer, "_fcdp_layered_leaf", False):
                continue
            for param in layer.parameters():
                if getattr(param, "ds_z3_leaf_module", None) is layer:
                    del param.ds_z3_leaf_module

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"layered_chunks": self.chunks, "layered_layers": len(self.layers), "layered_list": self.name,
                "layered_batches": c.batches, "layered_chunk_calls": c.chunk_calls, "layered_recomputes": c.recomputes,
                "layered_cache_turned_off": self.cache_turned_off, "layered_boundary_bytes": c.boundary_bytes,
                "layered_host_boundary_bytes": c.host_boundary_bytes, "layered_peak_boundary_bytes": c.peak_boundary_bytes}


def _chunked(layer: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """The ``forward`` installed on a layer: its call run by the stack attached to it ([Note: the newest stack])."""
    def layered_forward(*args: Any, **kwargs: Any) -> Any:
        return getattr(layer, _ATTACHED).run(layer, forward, args, kwargs)

    layered_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    return layered_forward


def _refuse_reentrant_checkpointing(layer: torch.nn.Module) -> None:
    """[Note: reentrant checkpointing around a layer] A Hugging Face layer checkpointed with ``use_reentrant=True``
    runs its forward without gradients (so whole, not layered) and its backward as a nested backward that DeepSpeed's
    hooks around the layer were not written for; transformers' default is non-reentrant, which composes. Checked at
    each call: the model's checkpointing can be switched on after the engine is built."""
    fn = getattr(layer, "_gradient_checkpointing_func", None)
    if getattr(layer, "gradient_checkpointing", False) and getattr(fn, "keywords", {}).get("use_reentrant"):
        raise split.LayeredCallError(
            f"fcdp.layered with the model's reentrant activation checkpointing of {type(layer).__name__} "
            f"(use_reentrant=True): layered accumulation already checkpoints every layer per chunk. Fix: "
            f"gradient_checkpointing_kwargs={{\"use_reentrant\": False}} (transformers' default), turn the model's "
            f"gradient checkpointing off, or remove fcdp.layered.")


def _nested_leaves(layer: torch.nn.Module) -> list[str]:
    return [name for name, sub in layer.named_modules() if name and getattr(sub, "_z3_leaf", False)]


def _tensor_bytes(value: Any, seen: dict | None = None) -> int:
    """Bytes of the distinct tensors in ``value`` not in ``seen`` (which they join; default: a fresh one). ``seen``
    maps ``id`` to a weak reference, so a tensor freed meanwhile (a boundary moved to the host) cannot pass its
    ``id`` on to a new one."""
    seen = {} if seen is None else seen
    total = [0]

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            ref = seen.get(id(v))
            if ref is None or ref() is not v:
                seen[id(v)] = weakref.ref(v)
                total[0] += v.numel() * v.element_size()
        elif isinstance(v, (tuple, list)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
    walk(value)
    return total[0]


def attach(model: torch.nn.Module, config: LayeredConfig | None, micro_batch: Optional[int] = None
           ) -> LayeredStack | None:
    """Run ``model``'s layers layered when ``fcdp.layered`` asks for it (before DeepSpeed hooks the model);
    ``micro_batch``: DeepSpeed's micro-batch per rank, where known ([Note: batch first])."""
    return LayeredStack(model, config, micro_batch) if config is not None else None
