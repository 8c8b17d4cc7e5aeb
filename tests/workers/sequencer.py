"""Workers of test_sequencer.py: stage 1 asynchronous on gloo, stage 2 issued in FIFO order at the waits
(``runtime/sequencer.py``), and a coalesced fetch gathered per module (``gather.PerModuleHandle``)."""
from __future__ import annotations

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

import fcdp_deepspeed
from fcdp_deepspeed.runtime.fetch import flat_reference
from fcdp_lab.harness import toy
from fcdp_lab import sabotage
from workers.common import fcdp_block, setup

HIDDEN = 32


def _engine(fcdp: bool, regime: str = "large", **extra):
    cfg = toy.ds_config(fcdp_block(miss_batch_bytes=0, **extra) if fcdp else None, regime=regime)
    return toy.build_engine(cfg, hidden=HIDDEN, layers=3)


def _exact(params: list) -> list[bool]:
    """Each gathered parameter equals DeepSpeed's flat gather of its partitions (collective, same order everywhere)."""
    return [torch.equal(p.data.reshape(-1), flat_reference(p)[:p.ds_numel]) for p in params]


def wait_orders(broken: str = "") -> dict:
    """Two same-size misses gathered as two handles; ranks of one node wait them in opposite orders (as DeepSpeed's
    per-rank ``set`` order can). Then one coalesced fetch of both per module: the handle completes only the part of
    the parameter whose module is active. ``broken``: a ``gather.*`` variant for the two waits (``fcdp_lab/sabotage/params.py``)."""
    setup()
    restore = sabotage.apply(f"gather.{broken}" if broken else "")
    engine = _engine(True)
    toy.train(engine, 1, hidden=HIDDEN)  # every trainable parameter is a miss again
    gather = engine.optimizer.fcdp.gather
    a, b = engine.module.blocks[0].fc.weight, engine.module.blocks[1].fc.weight
    out: dict = {"queued": gather.queue is not None}
    try:
        handles = [gather.issue([a]), gather.issue([b])]
        for h in (handles if dist.get_rank() % 2 == 0 else handles[::-1]):
            h.wait()
        out["exact"] = _exact([a, b])
    except Exception as err:  # the broken order may pair mismatched collectives
        out["error"] = repr(err)
        return out
    finally:
        restore()
    for p in (a, b):
        p.partition()
    handle = gather.issue([b, a], per_module=True)
    a.ds_active_sub_modules.add(12345)  # what the coordinator does before waiting a's handle
    handle.wait()
    out["first_wait"] = [a.ds_status.name, b.ds_status.name]
    a.ds_active_sub_modules.discard(12345)
    handle.wait()  # nothing active: every part
    out["second_wait"] = [a.ds_status.name, b.ds_status.name]
    out["exact_split"] = _exact([a, b])
    for p in (a, b):
        p.partition()
    return out


def late_peer() -> dict:
    """Plain ZeRO-3, FCDP, FCDP with stage 2 issued early (``gather.stage2_early``); both release regimes (DeepSpeed's
    prefetch on in ``default``). The test makes rank 2 issue every stage 1 late (``gather.delay@2=SECONDS``)."""
    setup()
    out = {}
    for regime in ("large", "default"):
        for name, fcdp, broken in (("plain", False, ""), ("fcdp", True, ""), ("early", True, "gather.stage2_early")):
            with sabotage.applied(broken):
                engine = _engine(fcdp, regime)
                res = toy.train(engine, 3, hidden=HIDDEN)
                out[f"{regime}_{name}"] = {"losses": res.losses,
                                           "stats": fcdp_deepspeed.get_stats(engine) if fcdp else {}}
    return out


def never_blocks_at_issue(delay_s: float = 0.3) -> dict:
    """Seconds the host spends issuing one miss whose stage 1 a peer starts ``delay_s`` late (rank 2), then
    waiting for it: with stage 1 asynchronous, the issue returns at once on every rank."""
    import time
    setup()
    engine = _engine(True)
    toy.train(engine, 1, hidden=HIDDEN)
    p = engine.module.blocks[0].fc.weight
    dist.barrier()
    if dist.get_rank() == 2:
        time.sleep(delay_s)
    t0 = time.perf_counter()
    handle = engine.optimizer.fcdp.gather.issue([p])
    issued = time.perf_counter() - t0
    handle.wait()
    waited = time.perf_counter() - t0
    exact = _exact([p])
    p.partition()
    assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
    return {"issue_s": issued, "wait_s": waited, "exact": exact}
