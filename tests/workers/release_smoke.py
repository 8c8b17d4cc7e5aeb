"""Worker of test_release_smoke.py: the release smoke subset in one 2 nodes x 2 process group (one
rank start-up per release check). Reuses the parity, gradient and refusal workers as they are."""
from __future__ import annotations

import deepspeed

import fcdp_deepspeed
from fcdp_lab.harness import toy
from workers import grads as grads_worker
from workers import parity as parity_worker
from workers.common import fcdp_block, setup

#: Full fine-tuning and LoRA (frozen base, 2 micro-steps per step): plain ZeRO-3 vs FCDP.
CACHE = [dict(name="full", steps=3), dict(name="lora", lora_rank=2, grad_accum=2, steps=3)]
#: The gradient modes against plain ZeRO-3 (4 optimizer steps each).
GRADS = [dict(name="hier_ga2", fcdp={"grad_reduce": "hierarchical"}, grad_accum=2, steps=4),
         dict(name="node_ga4", fcdp={"grad_accumulation": "node"}, grad_accum=4, steps=4),
         dict(name="lora_node_ga2", fcdp={"grad_accumulation": "node"}, grad_accum=2, steps=4, lora_rank=2)]
#: Config refusals: a malformed key, and a DeepSpeed setting that bypasses the gradient path.
REFUSALS = [{"fcdp": {"grad_reduce": "tree"}}, {"fcdp": {"grad_reduce": "hierarchical"}, "zero": {"reduce_scatter": False}}]


def startup_hook() -> dict:
    """Before anything calls ``install()``: did the startup hook install FCDP when DeepSpeed was
    imported, and does a config with the ``fcdp`` key alone build ``FCDPStage3``?"""
    installed = fcdp_deepspeed.is_installed()
    model = toy.ToyModel(16, 2)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=toy.ds_config(fcdp_block()))
    return {"installed": installed, "optimizer": type(engine.optimizer).__name__}


def smoke() -> dict:
    setup()
    out = {"deepspeed": deepspeed.__version__, "hook": startup_hook()}
    out["cache"] = parity_worker.parity(CACHE)
    out["grads"] = grads_worker.parity(GRADS)
    out["refusals"] = grads_worker.refusals(REFUSALS)
    return out
