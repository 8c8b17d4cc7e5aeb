"""Functions that run on every rank of a spawned gloo group (see conftest.run_ranks).

Each returns plain data (losses, weights, stats) for the test process to compare.
"""
from __future__ import annotations

import torch

import deepspeed
from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_deepspeed import toy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def setup(ranks_per_node: int = 2) -> None:
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    fcdp_deepspeed.enable_comm_counting(ranks_per_node=ranks_per_node)


def fcdp_block(ranks_per_node: int = 2, **extra) -> dict:
    return {"enabled": True, "ranks_per_node": ranks_per_node, **extra}


def run_scenario(sc: dict, fcdp: bool, ranks_per_node: int = 2) -> toy.RunResult:
    dtype = sc.get("dtype", "fp32")
    cfg = toy.ds_config(fcdp_block(ranks_per_node, **sc.get("fcdp", {})) if fcdp else None,
                        regime=sc.get("regime", "large"), grad_accum=sc.get("grad_accum", 1), dtype=dtype,
                        loss_scale_power=sc.get("loss_scale_power", 8),
                        **sc.get("zero", {}))
    engine = toy.build_engine(cfg, lora_rank=sc.get("lora_rank", 0), activation_checkpointing=sc.get("ckpt", False),
                              zero_init=sc.get("zero_init", False), layers=sc.get("layers", 4))
    res = toy.train(engine, sc.get("steps", 3), record_step_stats=True, record_phases=True, dtype=DTYPES[dtype])
    weights = toy.gather_weights(engine)  # collective: every rank gathers, rank 0 reports
    res.weights = weights if dist.get_rank() == 0 else {}
    res.extra["optimizer_class"] = type(engine.optimizer).__name__
    return res


def parity(scenarios: list[dict], ranks_per_node: int = 2) -> dict:
    """Every scenario twice, plain ZeRO-3 then FCDP, in one process group."""
    setup(ranks_per_node)
    return {sc["name"]: {mode: run_scenario(sc, mode == "fcdp", ranks_per_node) for mode in ("plain", "fcdp")}
            for sc in scenarios}


def stale_probe(break_invalidation: bool, verify: bool = False, steps: int = 3) -> dict:
    """Train with FCDP, optionally with invalidation switched off, to show a stale cache is caught."""
    from fcdp_deepspeed.runtime import FCDPRuntime, StaleCacheError
    setup()
    if break_invalidation:
        FCDPRuntime.invalidate_params = lambda self, params, reason: 0
        FCDPRuntime.invalidate_changed = lambda self: None
    sc = {"fcdp": {"verify": True}} if verify else {}
    plain = run_scenario({"steps": steps}, fcdp=False)
    try:
        fcdp = run_scenario({"steps": steps, **sc}, fcdp=True)
    except StaleCacheError as err:
        return {"raised": str(err), "plain": plain.losses}
    return {"raised": None, "plain": plain.losses, "fcdp": fcdp.losses, "stats": fcdp.stats}


def launcher_parity(steps: int = 3) -> dict:
    """Under a real launcher: the node layout comes from its environment, not from an override."""
    setup(ranks_per_node=None)
    out = {mode: run_scenario({"steps": steps}, mode == "fcdp", ranks_per_node=None) for mode in ("plain", "fcdp")}
    import os
    out["env"] = {k: os.environ.get(k) for k in ("GROUP_RANK", "CROSS_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "RANK")}
    return out
