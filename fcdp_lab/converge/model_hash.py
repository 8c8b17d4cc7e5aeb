"""Bitwise fingerprints of a ZeRO-3 model on one rank, to check that every rank holds the same model.

Two views, because lossy compression of the inter-node hop could make them differ:

- :func:`gathered_hash`: every parameter gathered by ``GatheredParameters`` (one at a time, see
  ``toy.gather_weights``), in the dtype the engine computes in;
- :func:`forward_hash`: every parameter as a forward pass actually sees it (read in a forward
  pre-hook, after DeepSpeed's own pre-hook has fetched it, through whatever path FCDP chose: cache hit,
  exact or compressed gather). This is the one that proves compressed replicas stay in lockstep.

Both are SHA-256 over (name, dtype, shape, raw bytes) in ``named_parameters`` order.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (any dtype, bf16 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def _digest(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in named:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def gathered_hash(engine) -> str:
    """SHA-256 of the full model, each parameter gathered on its own (collective: call on every rank)."""
    import deepspeed
    named = []
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            named.append((name, param.data.clone()))
    return _digest(named)


def forward_hash(engine, inputs: torch.Tensor) -> str:
    """SHA-256 of the parameters one ``no_grad`` eval forward of ``inputs`` computes with (collective)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def hook(module, args):
        for p in module.parameters(recurse=False):
            if p.numel() == 0 or p.data.numel() != p.ds_numel:
                raise RuntimeError(f"{names[id(p)]} is not gathered in its module's forward pre-hook")
            seen.setdefault(names[id(p)], p.data.clone())

    handles = [m.register_forward_pre_hook(hook) for m in engine.module.modules() if next(m.parameters(recurse=False), None) is not None]
    engine.eval()
    try:
        with torch.no_grad():
            engine(inputs)
    finally:
        engine.train()
        for h in handles:
            h.remove()
    missing = set(names.values()) - set(seen)
    if missing:
        raise RuntimeError(f"parameters not seen in the forward: {sorted(missing)}")
    return _digest([(n, seen[n]) for n in names.values()])


def all_equal(hashes: Sequence[str]) -> bool:
    """Every rank's fingerprint is the same (and there is at least one)."""
    return bool(hashes) and len(set(hashes)) == 1
