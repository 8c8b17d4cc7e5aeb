"""Rank workers for the gradient modes (grad_reduce / grad_accumulation): error against an exact
float64 reduction, parity with plain ZeRO-3, traffic per optimizer step.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.nn.functional as F

import deepspeed
from deepspeed import comm as dist
from deepspeed.utils import safe_get_local_grad

import fcdp_deepspeed
from fcdp_deepspeed import grads, toy
from fcdp_deepspeed.grads import own_chunk_numel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def setup(ranks_per_node: int) -> None:
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    fcdp_deepspeed.enable_comm_counting(ranks_per_node=ranks_per_node)


def sabotage(kind: str) -> None:
    """Deliberately broken variants, to show the tests can fail."""
    if kind == "wrong_peers":  # pair each rank with the wrong node peers' chunks
        original = grads.build_layout

        def build_layout(dp_ranks, node_of_rank, me):
            layout = original(dp_ranks, node_of_rank, me)
            return dataclasses.replace(layout, blocks=tuple(b[::-1] for b in layout.blocks))

        grads.build_layout = build_layout
    elif kind == "drop_buffer":  # forget the accumulated window at the boundary
        original_reduce = grads.GradReducer.reduce

        def reduce(self, params, tensors):
            if self.is_boundary():
                self.buffer.dirty.clear()
            return original_reduce(self, params, tensors)

        grads.GradReducer.reduce = reduce
    elif kind:
        raise ValueError(kind)


def _config(sc: dict, fcdp: dict | None) -> dict:
    return toy.ds_config(fcdp, regime=sc.get("regime", "large"), grad_accum=sc.get("grad_accum", 1),
                         dtype=sc.get("dtype", "fp32"), **sc.get("zero", {}))


def reference_errors(sc: dict, fcdp: dict | None) -> list[dict]:
    """Train ``sc`` and, at every accumulation boundary, compare this rank's gradient partition with
    the exact (float64) average of every rank's full fp32 gradient over the window."""
    cfg = _config(sc, fcdp)
    hidden = sc.get("hidden", 32)
    engine = toy.build_engine(cfg, hidden=hidden, lora_rank=sc.get("lora_rank", 0), layers=sc.get("layers", 4),
                              activation_checkpointing=sc.get("ckpt", False))
    ga = engine.gradient_accumulation_steps()
    world, rank = dist.get_world_size(), dist.get_rank()
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    out = []
    micro = 0
    for _ in range(sc.get("steps", 2)):
        weights = toy.gather_weights(engine)
        replica = toy.ToyModel(hidden, sc.get("layers", 4), sc.get("lora_rank", 0))
        replica.load_state_dict(weights)
        exact = {n: torch.zeros(p.ds_numel, dtype=torch.float64) for n, p in named}
        for _ in range(ga):
            x, y = toy.batch(micro, engine.train_micro_batch_size_per_gpu(), hidden)
            replica.zero_grad()
            (F.mse_loss(replica(x), y) / ga).backward()
            rp = dict(replica.named_parameters())
            for n, _ in named:
                exact[n] += rp[n].grad.reshape(-1).double()
            engine.backward(F.mse_loss(engine(x), y))
            if engine.is_gradient_accumulation_boundary():
                err = ref_max = 0.0
                for n, p in named:
                    dist.all_reduce(exact[n], group=None)
                    chunk = -(-p.ds_numel // world)
                    own = own_chunk_numel(p.ds_numel, world, rank)
                    ref = (exact[n] / world).narrow(0, rank * chunk, own) if own else exact[n][:0]
                    got = safe_get_local_grad(p).reshape(-1)[:own].double()
                    err = max(err, (got - ref).abs().max().item() if own else 0.0)
                    ref_max = max(ref_max, ref.abs().max().item() if own else 0.0)
                out.append({"abs_err": err, "ref_max": ref_max})
            engine.step()
            micro += 1
    return out


def error_bounds(scenarios: list[dict], ranks_per_node: int, break_kind: str = "") -> dict:
    """Per scenario: boundary errors of plain ZeRO-3 (flat) and of each FCDP gradient mode."""
    setup(ranks_per_node)
    sabotage(break_kind)
    result = {}
    for sc in scenarios:
        modes = {"zero3": None, **{name: {"enabled": True, "ranks_per_node": ranks_per_node, **block}
                                   for name, block in sc["modes"].items()}}
        result[sc["name"]] = {name: reference_errors(sc, block) for name, block in modes.items()}
    return result


def parity(scenarios: list[dict], ranks_per_node: int = 2, break_kind: str = "") -> dict:
    """Each scenario with plain ZeRO-3 and with FCDP (``sc["fcdp"]``): losses, weights, stats."""
    setup(ranks_per_node)
    sabotage(break_kind)
    out = {}
    for sc in scenarios:
        runs = {}
        for mode in ("plain", "fcdp"):
            block = {"enabled": True, "ranks_per_node": ranks_per_node, **sc.get("fcdp", {})} if mode == "fcdp" else None
            cfg = _config(sc, block)
            engine = toy.build_engine(copy.deepcopy(cfg), hidden=sc.get("hidden", 32), lora_rank=sc.get("lora_rank", 0),
                                      layers=sc.get("layers", 4), activation_checkpointing=sc.get("ckpt", False),
                                      zero_init=sc.get("zero_init", False))
            res = toy.train(engine, sc.get("steps", 10), hidden=sc.get("hidden", 32), record_step_stats=True,
                            dtype=DTYPES[sc.get("dtype", "fp32")])
            weights = toy.gather_weights(engine)
            res.weights = weights if dist.get_rank() == 0 else {}
            res.extra["optimizer_class"] = type(engine.optimizer).__name__
            runs[mode] = res
        out[sc["name"]] = runs
    return out
