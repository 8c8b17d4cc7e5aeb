"""Workers of test_runahead.py: stage 1 run ahead at the step's end or from the window's first fetch
(``runtime/runahead.py``), correct and broken."""
from __future__ import annotations

import deepspeed
from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_deepspeed.storage import freshness
from fcdp_lab.harness import toy
from fcdp_lab import sabotage
from workers.common import fcdp_block, forward, setup

HIDDEN = 32


def _edit_trainable(engine, delta: float) -> None:
    """``GatheredParameters(modifier_rank=0)`` after a step: a weight whose stage 1 is already pushed changes."""
    param = engine.module.blocks[1].fc.weight
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if dist.get_rank() == 0:
            param.data.add_(delta)


#: A budget of about one module's group (a block's fc: 32 x 32 + 32 fp32 elements, 4,224 bytes at full size): the
#: step's end pushes the first group, each fetch that takes one issues the next ([Note: a rolling push]).
ROLLING_BYTES = 6000


def _run(fcdp: bool, ckpt_dir: str, tag: str, budget: int = 2**30, window: int = 0) -> dict:
    """``budget``: the push from the step's end (opt-in); ``window``: with ``budget`` 0, the default run-ahead from
    the window's first fetch with that budget ([Note: from the window's first fetch])."""
    block = fcdp_block(param_push_bytes=budget) if budget else fcdp_block(param_runahead_bytes=window)
    cfg = toy.ds_config(block if fcdp else None, regime="large")
    engine = toy.build_engine(cfg, hidden=HIDDEN, layers=3)
    # from the third step on nothing synchronizes the ranks between a push and its use (DeepSpeed's trace is complete)
    losses = toy.train(engine, 3, hidden=HIDDEN).losses
    engine.save_checkpoint(ckpt_dir, tag=tag)
    losses += toy.train(engine, 1, hidden=HIDDEN, seed=2).losses
    # a checkpoint load after a step: every pushed group now holds newer values than the weights (misses still)
    engine.load_checkpoint(ckpt_dir, tag=tag)
    out = forward(engine, HIDDEN)
    losses += toy.train(engine, 1, hidden=HIDDEN, seed=3).losses
    _edit_trainable(engine, 0.25)  # after a step: the edited weight's pushed group is cancelled
    out2 = forward(engine, HIDDEN)
    losses += toy.train(engine, 1, hidden=HIDDEN, seed=1).losses
    return {"losses": losses, "out": out, "out2": out2, "stats": fcdp_deepspeed.get_stats(engine) if fcdp else {}}


def variants(ckpt_dir: str) -> dict:
    """Plain ZeRO-3, FCDP with the run-ahead, and each broken variant (``push.*``, applied for its run); the test
    makes rank 2 push late (``FCDP_LAB_BREAK=push.delay@2=SECONDS``)."""
    setup()
    out = {"plain": _run(False, ckpt_dir, "plain")}
    checked = freshness.is_current
    for name, broken, budget in (("fcdp", "", 2**30), ("read_early", "read_early", 2**30),
                                 ("skip_invalidation", "skip_invalidation", 2**30),
                                 ("skip_invalidation_unchecked", "skip_invalidation", 2**30),
                                 ("rolling", "", ROLLING_BYTES),
                                 ("rolling_skip_invalidation", "skip_invalidation", ROLLING_BYTES),
                                 ("window", "", 0), ("window_rolling", "", 0), ("window_read_early", "read_early", 0)):
        if name.endswith("_unchecked"):  # the check at use skipped too ([Note: freshness by construction])
            freshness.is_current = lambda param, taken: True
        with sabotage.applied(f"push.{broken}" if broken else ""):
            out[name] = _run(True, ckpt_dir, name, budget, window=ROLLING_BYTES if name == "window_rolling" else 2**30)
        freshness.is_current = checked
    out["lora"] = lora()  # in the same ranks: the LoRA test needs no process group of its own
    out["compressed"] = compressed()
    return out


def _gather_together(engine, params: list) -> None:
    """One two-stage gather of ``params`` (misses after a step) as a fetch that coalesces them makes it, then released
    as after use. (``GatheredParameters`` takes DeepSpeed's flat gather, which no reference depends on.)"""
    handle = engine.optimizer.fcdp.gather.issue(params)
    handle.wait()
    for p in params:
        p.partition(has_been_updated=False)


def compressed(steps: int = 3) -> dict:
    """``fcdp.param_compression`` int4 with the run-ahead ([Note: compressed groups run ahead]): without it, from the
    window's first fetch, the push from the step's end, and the broken variants. Between steps one two-stage gather
    takes two weights together (:func:`_gather_together`; its compressed stage 1 rewrites their references): the
    groups pushed at the step's end that hold them (one per module) must be dropped. Cached, the weights are hits
    after it; without cache slots (``min_numel``) the forward gathers them again, from those groups if they were kept.
    Rank 2's push is late (``variants``' skew)."""
    out = {}
    uncached = {"min_numel": 10**6}  # no cache slot: every fetch is a two-stage gather (references only)
    for name, extra, broken in (("off", {"param_runahead_bytes": 0}, ""), ("window", {}, ""),
                                ("push", {"param_push_bytes": 2**30}, ""),
                                ("window_read_early", {}, "read_early"),
                                ("off_uncached", {"param_runahead_bytes": 0, **uncached}, ""),
                                ("push_uncached", {"param_push_bytes": 2**30, **uncached}, ""),
                                ("push_uncached_stale", {"param_push_bytes": 2**30, **uncached}, "stale_reference"),
                                ("push_refresh", {"param_push_bytes": 2**30, "param_refresh_interval": 2}, "")):
        with sabotage.applied(f"push.{broken}" if broken else ""):
            cfg = toy.ds_config(fcdp_block(param_compression="int4", **extra), regime="large")
            engine = toy.build_engine(cfg, hidden=HIDDEN, layers=3)
            losses = toy.train(engine, steps, hidden=HIDDEN).losses
            if name != "push_refresh":
                _gather_together(engine, [engine.module.blocks[i].fc.weight for i in (1, 2)])
            losses += toy.train(engine, steps, hidden=HIDDEN, seed=1).losses
            stats = fcdp_deepspeed.get_stats(engine)
            out[name] = {"losses": losses, "out": forward(engine, HIDDEN),
                         "stats": {k: v for k, v in stats.items() if k.startswith(("param_push", "param_compressed"))}}
    return out


def lora(steps: int = 3) -> dict:
    """A LoRA model (adapters trainable, the rest frozen): the run-ahead's plan is the batched refill alone, one group
    ([Note: one group runs nothing ahead]); plain ZeRO-3 and FCDP with the default run-ahead."""
    setup()
    out = {}
    for name, fcdp in (("plain", False), ("fcdp", True)):
        cfg = toy.ds_config(fcdp_block(param_runahead_bytes=2**30) if fcdp else None, regime="large")
        engine = toy.build_engine(cfg, hidden=HIDDEN, layers=3, lora_rank=2)
        losses = toy.train(engine, 2, hidden=HIDDEN).losses  # the first windows' plans come from per-module misses
        before = fcdp_deepspeed.get_stats(engine) if fcdp else {}
        losses += toy.train(engine, steps, hidden=HIDDEN, seed=1).losses  # each plan: the batched refill alone
        after = fcdp_deepspeed.get_stats(engine) if fcdp else {}
        out[name] = {"losses": losses, "out": forward(engine, HIDDEN),
                     "steady": {k: after[k] - before[k] for k in ("param_push_groups", "batched_refills")} if fcdp else {}}
    return out


def prefetch(steps: int = 4) -> dict:
    """DeepSpeed's default prefetch (one coalesced fetch for the rest of the forward once the trace is complete,
    none before): plain ZeRO-3 and FCDP with the run-ahead; the pushes of the window without prefetch must be used
    by the window with it (per-module groups either way, ``gather.PerModuleHandle``)."""
    setup()
    out = {}
    for name, fcdp in (("plain", False), ("fcdp", True)):
        cfg = toy.ds_config(fcdp_block(param_push_bytes=2**30) if fcdp else None, regime="default")
        engine = toy.build_engine(cfg, hidden=HIDDEN, layers=3)
        res = toy.train(engine, steps, hidden=HIDDEN)
        out[name] = {"losses": res.losses, "stats": fcdp_deepspeed.get_stats(engine) if fcdp else {}}
    return out
