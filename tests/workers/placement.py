"""Workers of test_placement.py: cache_device modes, budgets, allocation failures."""
from __future__ import annotations

import logging

from workers.common import LogCapture, run_scenario, setup


def _announced(message: str) -> bool:
    """The engine's ON line (``announce.py``, a WARNING so it shows by default): not a budget warning."""
    return message.startswith("fcdp: ON for this engine")


def placement_modes(steps: int = 5, host_budget_bytes: int = 0) -> dict:
    """Plain ZeRO-3 vs each cache_device mode and a host budget smaller than the model."""
    setup()
    capture = LogCapture()
    variants = {
        "plain": None,
        "host": {"cache_device": "host"},
        "device": {"cache_device": "device"},
        "auto": {"cache_device": "auto"},
        "small_budget": {"cache_device": "host", "host_budget": host_budget_bytes},
    }
    out = {}
    for name, extra in variants.items():
        before = len(capture.messages)
        sc = {"steps": steps, "fcdp": extra or {}}
        res = run_scenario(sc, fcdp=extra is not None)
        res.extra["log"] = [m for m in capture.messages[before:] if m.startswith("fcdp:")]
        res.extra["warnings"] = [m for m, level in zip(capture.messages[before:], capture.levels[before:])
                                 if m.startswith("fcdp:") and level >= logging.WARNING and not _announced(m)]
        out[name] = res
    return out


def degraded_allocation(steps: int = 4, chunk_bytes: int = 4096) -> dict:
    """Pool chunks fail to allocate on one rank (FCDP_INJECT_FAULT): the parameters in them must
    take the plain ZeRO-3 path on every rank, with a warning, and training must stay identical."""
    from fcdp_deepspeed.storage import cache
    cache.CHUNK_BYTES = chunk_bytes  # several chunks, so only some parameters are affected
    setup()
    capture = LogCapture()
    plain = run_scenario({"steps": steps}, fcdp=False)
    fcdp = run_scenario({"steps": steps}, fcdp=True)
    return {"plain": plain.losses, "fcdp": fcdp.losses, "stats": fcdp.stats, "log": capture.fcdp()}


def one_node(steps: int = 3) -> dict:
    """4 ranks on one node, through deepspeed.initialize: with no fcdp.ranks_per_node (the hostname
    layout) and with ranks_per_node = 4, node accumulation on, vs plain ZeRO-3."""
    import copy

    from fcdp_lab.harness import toy
    setup(4)
    capture = LogCapture()
    out = {}
    for name, block in (("plain", None), ("hostname", {"enabled": True, "grad_accumulation": "node"}),
                        ("rpn4", {"enabled": True, "ranks_per_node": 4, "grad_accumulation": "node"})):
        before = len(capture.messages)
        engine = toy.build_engine(copy.deepcopy(toy.ds_config(block, grad_accum=2)))
        res = toy.train(engine, steps, record_step_stats=True)
        res.weights = toy.gather_weights(engine)
        res.extra["log"] = [m for m, level in zip(capture.messages[before:], capture.levels[before:])
                            if m.startswith("fcdp:") and level >= logging.WARNING and not _announced(m)]  # info lines aside
        res.extra["optimizer_class"] = type(engine.optimizer).__name__
        cache = engine.optimizer.fcdp.cache if block else None
        res.extra["pools"] = sum(p is not None for p in cache.pools.values()) if cache else 0
        out[name] = res
    return out
