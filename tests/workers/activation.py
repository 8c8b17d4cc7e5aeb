"""Workers of test_activation.py: what an enabled block does through ``deepspeed.initialize`` when it
cannot do what it says (ZeRO stage < 3, a cache that holds nothing). None of them calls ``install()``:
the startup hook installed FCDP when DeepSpeed was imported."""
from __future__ import annotations

import logging

import torch

import deepspeed
from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_lab.harness import toy
from workers.common import ZERO3_GRADS, LogCapture


def _init() -> bool:
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    return fcdp_deepspeed.is_installed()


def low_stage_refused(stages: tuple = (0, 1, 2)) -> dict:
    """``deepspeed.initialize`` with an enabled block at each ZeRO stage < 3, a plain and a pipeline
    model: the error each raised (or ``None``)."""
    from deepspeed.pipe import PipelineModule

    out = {"installed": _init(), "initialize": {}, "pipeline": {}}
    for stage in stages:
        cfg = toy.ds_config({"enabled": True, **ZERO3_GRADS}, regime="default")
        cfg["zero_optimization"] = {"stage": stage}
        model = toy.ToyModel(16, 2)
        out["initialize"][stage] = _error_of(lambda: deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                           config=cfg))
        if stage < 2:  # DeepSpeed's pipeline engine supports stages 0 and 1
            pipe = PipelineModule(layers=[torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)], num_stages=1)
            out["pipeline"][stage] = _error_of(lambda: deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(),
                                                                             config=cfg))
    return out


def _error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # the test checks the type and message
        return f"{type(exc).__name__}: {exc}"
    return None


def nothing_cached(case: str) -> dict:
    """An enabled engine whose cache gets no parameter; rank 0's ``fcdp:`` warnings and the stats.

    ``persistent``: DeepSpeed's default ``stage3_param_persistence_threshold`` (1e5 elements) keeps
    every toy parameter gathered. ``budget``: ``host_budget: 0``. ``min_numel``: every parameter below
    ``fcdp.min_numel``, the gradient modes left at their defaults.
    """
    installed = _init()
    log = LogCapture()
    block = {"enabled": True, "ranks_per_node": 2, **({"host_budget": 0} if case == "budget" else {})}
    if case == "min_numel":  # every parameter below it; the gradient modes stay the defaults (hierarchical)
        block["min_numel"] = 10**9
    else:
        block.update(ZERO3_GRADS)
    cfg = toy.ds_config(block, regime="large")
    if case == "persistent":
        del cfg["zero_optimization"]["stage3_param_persistence_threshold"]
    torch.manual_seed(0)
    model = toy.ToyModel(32, 2)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    res = toy.train(engine, 2)
    return {"installed": installed, "warnings": log.fcdp("fcdp:", min_level=logging.WARNING) if dist.get_rank() == 0 else [],
            "stats": res.stats, "optimizer": type(engine.optimizer).__name__}
