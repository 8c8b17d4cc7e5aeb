"""Workers of test_invalidation.py: a stale cache on purpose, and every value-changing event."""
from __future__ import annotations

import torch

import deepspeed
from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_lab.harness import toy
from workers.common import fcdp_block, forward, run_scenario, setup


def stale_probe(break_invalidation: bool, verify: bool = False, steps: int = 3, break_check: bool = False) -> dict:
    """Train with FCDP, optionally with the optimizer's invalidation listeners deleted (the check at use then finds
    the stale slots: [Note: freshness by construction]) and optionally the check at use skipped too."""
    from fcdp_deepspeed.runtime import FCDPRuntime, StaleCacheError
    from fcdp_deepspeed.storage import freshness
    setup()
    if break_invalidation:
        FCDPRuntime.invalidate_params = lambda self, params, reason: 0
        FCDPRuntime.invalidate_changed = lambda self: None
    if break_check:
        freshness.is_current = lambda param, taken: True
    sc = {"fcdp": {"verify": True}} if verify else {}
    plain = run_scenario({"steps": steps}, fcdp=False)
    try:
        fcdp = run_scenario({"steps": steps, **sc}, fcdp=True)
    except StaleCacheError as err:
        return {"raised": str(err), "plain": plain.losses}
    return {"raised": None, "plain": plain.losses, "fcdp": fcdp.losses, "stats": fcdp.stats}


def _edit_frozen(engine, delta: float) -> None:
    """``GatheredParameters(modifier_rank=0)``: rank 0 edits a frozen weight, DeepSpeed broadcasts it."""
    param = engine.module.blocks[1].fc.weight
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if dist.get_rank() == 0:
            param.data.add_(delta)


def invalidation_events(ckpt_dir: str, hidden: int = 64, lora_rank: int = 2) -> dict:
    """Every value-changing event, plain vs FCDP: outputs and losses after each must be identical."""
    setup()
    out: dict = {}
    for mode in ("plain", "fcdp"):
        rec: dict = {}
        cfg = toy.ds_config(fcdp_block() if mode == "fcdp" else None, regime="large")
        engine = toy.build_engine(cfg, hidden=hidden, lora_rank=lora_rank)
        train = lambda n, seed: toy.train(engine, n, hidden=hidden, seed=seed).losses  # noqa: E731
        rec["warm"] = train(2, 0)
        engine.save_checkpoint(ckpt_dir, tag=f"{mode}-s2")
        rec["warm_fwd"] = forward(engine, hidden)  # re-fills the cache the save flushed
        # 1. GatheredParameters edit of a frozen (cached) weight on rank 0 only.
        _edit_frozen(engine, 0.5)
        rec["after_edit_fwd"] = forward(engine, hidden)
        rec["after_edit_train"] = train(2, 1)
        # 2. load_checkpoint restores frozen + trainable values written before the edit.
        engine.load_checkpoint(ckpt_dir, tag=f"{mode}-s2")
        rec["after_load_fwd"] = forward(engine, hidden)
        rec["after_load_train"] = train(1, 2)
        # 3. 16-bit consolidation in the middle of training.
        engine.save_16bit_model(ckpt_dir, f"{mode}-model.bin")
        rec["after_16bit_train"] = train(2, 3)
        # 4. Unfreeze a frozen (cached) layer between steps, then freeze a trainable one.
        unfrozen = engine.module.blocks[0].fc.weight
        before = toy.gather_weights(engine)["blocks.0.fc.weight"]
        unfrozen.requires_grad = True
        rec["after_unfreeze_train"] = train(2, 4)
        rec["unfrozen_changed"] = not torch.equal(before, toy.gather_weights(engine)["blocks.0.fc.weight"])
        engine.module.blocks[2].lora_a.requires_grad = False
        rec["after_freeze_train"] = train(2, 5)
        rec["stats"] = fcdp_deepspeed.get_stats(engine)
        weights = toy.gather_weights(engine)
        rec["weights"] = weights if dist.get_rank() == 0 else {}
        # A fresh plain engine (different init) loading the checkpoint is the reference for the load.
        fresh = toy.build_engine(toy.ds_config(None, regime="large"), hidden=hidden, lora_rank=lora_rank, seed=99)
        fresh.load_checkpoint(ckpt_dir, tag=f"{mode}-s2")
        rec["fresh_load_fwd"] = forward(fresh, hidden)
        out[mode] = rec
    return out
