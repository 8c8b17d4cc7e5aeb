"""Rank workers for the two-stage parameter gather (``fcdp.param_gather``): parity with DeepSpeed's
flat ring, inter-node bytes per miss, and a deliberately broken permutation."""
from __future__ import annotations

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

import fcdp_deepspeed
from fcdp_deepspeed.runtime import gather, refill
from fcdp_lab.harness import toy
from workers.common import setup
from workers.grads import _config, build, train


def sabotage(kind: str) -> None:
    """Deliberately broken variants, to show the tests can fail."""
    if kind == "no_permutation":  # read partitions in slot order as if it were DeepSpeed's rank order
        gather.slot_of_rank = lambda layout: tuple(range(layout.dp_size))
    elif kind == "batch_skips_gather":  # the batch marks slots filled from whatever they held (stale values)
        def stale_refill(self):
            params = self.batch()
            for p in params:
                entry = self.cache.entry(p)
                entry.state, p.ds_secondary_tensor = refill.EntryState.FILLED, entry.slot
            return params
        refill.MissBatcher.refill = stale_refill
    elif kind:
        raise ValueError(kind)


def parity(scenarios: list[dict], ranks_per_node: int = 2, break_kind: str = "") -> dict:
    """Each scenario with ``param_gather`` flat and hierarchical (same other keys): losses, weights, stats."""
    setup(ranks_per_node)
    sabotage(break_kind)
    out = {}
    for sc in scenarios:
        runs = {}
        for mode in ("flat", "hierarchical"):
            block = {"enabled": True, "ranks_per_node": ranks_per_node, **sc.get("fcdp", {}), "param_gather": mode}
            engine = build(sc, _config(sc, block))
            res = train(engine, sc)
            if sc.get("eval"):
                res.extra["eval"] = toy.evaluate(engine, torch.randn(2, sc.get("hidden", 32),
                                                                     generator=torch.Generator().manual_seed(7)))
                res.extra["eval_stats"] = fcdp_deepspeed.get_stats(engine)
            weights = toy.gather_weights(engine)
            res.weights = weights if dist.get_rank() == 0 else {}
            runs[mode] = res
        out[sc["name"]] = runs
    return out


def miss_bytes(ranks_per_node: int = 2, mode: str = "hierarchical", break_kind: str = "") -> dict:
    """Gather every parameter once as a cache miss (explicitly, outside the coordinator); per parameter,
    the inter-node all-gather bytes this rank's node received (sum over its ranks) and the parameter's
    aligned bytes, and whether the gathered value equals DeepSpeed's flat gather of the partitions."""
    setup(ranks_per_node)
    sabotage(break_kind)
    # one parameter at a time: no batched refill (it would gather every stale parameter at the first miss)
    cfg = toy.ds_config({"enabled": True, "ranks_per_node": ranks_per_node, "param_gather": mode, "miss_batch_bytes": 0})
    engine = toy.build_engine(cfg)
    node_group = engine.optimizer.fcdp.topology.group
    world = dist.get_world_size()
    rows = []
    for name, p in engine.module.named_parameters():
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.ds_secondary_tensor is None
        before = fcdp_deepspeed.get_stats(engine)["inter_node_allgather_bytes"]
        p.all_gather_coalesced([p]).wait()
        got = torch.tensor([fcdp_deepspeed.get_stats(engine)["inter_node_allgather_bytes"] - before])
        dist.all_reduce(got, group=node_group)
        reference = torch.empty(p.ds_tensor.numel() * world, dtype=p.ds_tensor.dtype)
        dist.all_gather_into_tensor(reference, p.ds_tensor.data, group=p.ds_process_group)
        exact = torch.equal(p.data.reshape(-1), reference[:p.ds_numel])
        rows.append({"name": name, "node_inter_bytes": int(got.item()), "exact": exact,
                     "aligned_bytes": p.ds_tensor.numel() * world * p.ds_tensor.element_size()})
        p.partition()
    return {"rows": rows, "stats": fcdp_deepspeed.get_stats(engine)}


def megatron(steps: int = 2, tp: int = 2, ranks_per_node: int = 4) -> dict:
    """TP=tp on the world (ZeRO's DP group a strict subgroup): plain ZeRO-3 and FCDP with each gather."""
    import deepspeed
    from workers.topology import MiniMPU
    setup(ranks_per_node)
    mpu = MiniMPU(tp)
    tp_rank = mpu.get_model_parallel_rank()
    fcdp_deepspeed.install()
    out = {}
    for name in ("plain", "flat", "hierarchical"):
        block = None if name == "plain" else {"enabled": True, "ranks_per_node": ranks_per_node, "param_gather": name,
                                              "grad_reduce": "flat", "grad_accumulation": "rank"}  # ZeRO-3's sums
        cfg = toy.ds_config(block, regime="large")
        torch.manual_seed(100 + tp_rank)  # TP peers hold different values
        with deepspeed.zero.Init(config_dict_or_path=cfg, mpu=mpu, data_parallel_group=mpu.get_data_parallel_group()):
            model = toy.ToyModel(32, 4)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
        res = toy.train(engine, steps, seed=tp_rank)
        out[name] = {"losses": res.losses, "stats": res.stats}
    return out


#: The runs of :func:`batched`: the defaults, batching off, and the run-ahead on (it pushes the batch).
BATCHED_RUNS = {"batched": {"param_push_bytes": 0}, "unbatched": {"miss_batch_bytes": 0, "param_push_bytes": 0},
                "pushed": {"param_push_bytes": 2**30}}


def batched(steps: int = 3, ranks_per_node: int = 2, break_kind: str = "", verify: bool = False,
            runs: tuple = ("batched", "unbatched")) -> dict:
    """LoRA through ``deepspeed.initialize`` (large release regime), ``miss_batch_bytes`` default and 0 (and the
    run-ahead with ``pushed``): losses, weights, and inter-node all-gathers per optimizer step after the first."""
    setup(ranks_per_node)
    sabotage(break_kind)
    sc = dict(lora_rank=2, steps=steps, eval=True)
    out = {}
    for name, extra in ((run, BATCHED_RUNS[run]) for run in runs):
        block = {"enabled": True, "ranks_per_node": ranks_per_node, "verify": verify, **extra}
        engine = build(sc, _config(sc, block))
        res = train(engine, sc)
        calls = [s["inter_node_allgather_calls"] for s in res.step_stats]
        res.extra["eval"] = toy.evaluate(engine, torch.randn(2, 32, generator=torch.Generator().manual_seed(7)))
        weights = toy.gather_weights(engine)  # collective
        out[name] = {"losses": res.losses, "eval": res.extra["eval"], "stats": res.stats,
                     "weights": weights if dist.get_rank() == 0 else {},
                     "allgathers_per_step": [b - a for a, b in zip(calls, calls[1:])],
                     "adapted": sum(1 for p in engine.module.parameters() if p.requires_grad)}
    return out
