"""Workers of test_layered.py: layered (breadth-first) accumulation against ZeRO-3's accumulation window."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import deepspeed
from deepspeed import comm as dist
from deepspeed.utils import safe_get_local_grad

import fcdp_deepspeed
from fcdp_deepspeed.grads import own_chunk_numel
from fcdp_lab.harness import toy
from workers.common import setup

HIDDEN = 32


def _engine(block: dict | None, ga: int, micro: int, regime: str, lora: int, ckpt: bool, dtype: str = "fp32"):
    cfg = toy.ds_config(block, regime=regime, grad_accum=ga, micro_batch=micro, dtype=dtype)
    return toy.build_engine(cfg, hidden=HIDDEN, lora_rank=lora, activation_checkpointing=ckpt)


def _window(step: int, ga: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of optimizer step ``step`` as ZeRO-3 with ``ga`` micro-steps of ``micro`` reads them."""
    return [toy.batch(step * ga + m, micro, HIDDEN) for m in range(ga)]


def _exact_grads(engine, window, lora: int) -> dict[str, torch.Tensor]:
    """This rank's share of the float64 gradient of the window's mean loss, averaged over every rank."""
    weights = toy.gather_weights(engine)
    replica = _like(engine.module, weights, lora)
    ga = len(window)
    replica.zero_grad()
    for x, y in window:
        (F.mse_loss(replica(x.double()), y.double()) / ga).backward()
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        exact = dict(replica.named_parameters())[n].grad.reshape(-1).clone()
        dist.all_reduce(exact)
        chunk, own = -(-p.ds_numel // world), own_chunk_numel(p.ds_numel, world, rank)
        out[n] = (exact / world).narrow(0, rank * chunk, own) if own else exact[:0]
    return out


def _like(module, weights: dict, lora: int) -> torch.nn.Module:
    layers = sum(1 for k in weights if k.endswith(".fc.weight"))
    replica = toy.ToyModel(HIDDEN, layers, lora).double()
    replica.load_state_dict({k: v.double() for k, v in weights.items()})
    for n, p in replica.named_parameters():
        p.requires_grad = dict(module.named_parameters())[n].requires_grad
    return replica


def _grad_error(engine, exact: dict) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    err = 0.0
    for n, p in engine.module.named_parameters():
        if n in exact and exact[n].numel():
            own = own_chunk_numel(p.ds_numel, world, rank)
            err = max(err, (safe_get_local_grad(p).reshape(-1)[:own].double() - exact[n]).abs().max().item())
    t = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run(block: dict | None, *, ga: int, micro: int, chunks_of: int, steps: int, regime: str, lora: int = 0,
        ckpt: bool = False, check_grads: bool = True) -> dict:
    """``steps`` optimizer steps; each reads the window of ``chunks_of`` micro-batches of ``micro`` examples, as
    ``ga`` micro-steps of ``chunks_of // ga`` batches each (ZeRO-3: ga = chunks_of; layered: ga = 1)."""
    engine = _engine(block, ga, micro * chunks_of // ga, regime, lora, ckpt)
    losses, errors = [], []
    keys = ("intra_node_allgather_calls", "inter_node_allgather_calls", "intra_node_allgather_bytes",
            "inter_node_allgather_bytes")
    per_step = dict.fromkeys(keys, 0.0)
    for step in range(steps):
        window = _window(step, chunks_of, micro)
        exact = _exact_grads(engine, window, lora) if check_grads else {}  # its gathers are not the window's
        before = fcdp_deepspeed.get_stats(engine)
        per = chunks_of // ga
        window_loss = 0.0
        for m in range(ga):
            part = window[m * per:(m + 1) * per]
            x, y = torch.cat([p[0] for p in part]), torch.cat([p[1] for p in part])
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary() and check_grads:
                errors.append(_grad_error(engine, exact))
            engine.step()
            window_loss += loss.item() / ga
        losses.append(window_loss)
        after = fcdp_deepspeed.get_stats(engine)
        for k in keys:
            per_step[k] += (after.get(k, 0) - before.get(k, 0)) / steps
    weights = toy.gather_weights(engine)
    stats = fcdp_deepspeed.get_stats(engine)
    return {"losses": losses, "grad_errors": errors, "weights": weights if dist.get_rank() == 0 else {},
            "stats": {k: v for k, v in stats.items() if k.startswith(("layered_", "paths", "cache_"))}, "per_step": per_step}


def compare(regime: str = "large", chunks: int = 4, micro: int = 2, steps: int = 3, lora: int = 0,
            ckpt: bool = False, fcdp_extra: dict | None = None, ranks_per_node: int = 2) -> dict:
    """ZeRO-3 accumulating ``chunks`` micro-steps, FCDP without layered at GA 1 over the whole window (the
    gathers a window should cost), and FCDP layered in ``chunks`` chunks at GA 1."""
    setup(ranks_per_node)
    fcdp = {"enabled": True, "ranks_per_node": ranks_per_node, **(fcdp_extra or {})}
    common = dict(micro=micro, chunks_of=chunks, steps=steps, regime=regime, lora=lora, ckpt=ckpt)
    out = {"zero3": run(None, ga=chunks, **common),
           "whole": run(fcdp, ga=1, check_grads=False, **common),
           "layered": run({**fcdp, "layered": chunks}, ga=1, **common)}
    dist.barrier()
    return out


def gathers(regime: str = "large", chunks: int = 4, micro: int = 2, steps: int = 2, link: str = "slow",
            ranks_per_node: int = 2) -> dict:
    """All-gather calls and bytes per step (``get_stats``): the window as one batch without ``fcdp.layered``, and
    layered in ``chunks`` chunks, on the paths ``link`` declares (no check between the steps)."""
    setup(ranks_per_node)
    fcdp = {"enabled": True, "ranks_per_node": ranks_per_node, "link": link}
    common = dict(ga=1, micro=micro, chunks_of=chunks, steps=steps, regime=regime, check_grads=False)
    out = {"whole": run(fcdp, **common)["per_step"], "layered": run({**fcdp, "layered": chunks}, **common)["per_step"]}
    dist.barrier()
    return out
