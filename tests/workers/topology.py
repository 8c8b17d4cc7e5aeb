"""Workers of test_topology.py: node layouts from launchers, bad layouts, a Megatron-style DP subgroup."""
from __future__ import annotations

import torch

import deepspeed
from deepspeed import comm as dist

from fcdp_lab.harness import toy
from workers.common import GroupMPU, fcdp_block, run_scenario, setup


def launcher_parity(steps: int = 3) -> dict:
    """Under a real launcher: the node layout comes from its environment, not from an override."""
    setup(ranks_per_node=None)
    out = {mode: run_scenario({"steps": steps}, mode == "fcdp", ranks_per_node=None) for mode in ("plain", "fcdp")}
    import os
    out["env"] = {k: os.environ.get(k) for k in ("GROUP_RANK", "CROSS_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "RANK")}
    return out


def topology_error(ranks_per_node=None) -> str:
    """Build an FCDP engine with a bad layout; return the error every rank raised."""
    setup(ranks_per_node=None)
    try:
        toy.build_engine(toy.ds_config(fcdp_block(ranks_per_node), regime="large"))
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "no error"


class MiniMPU(GroupMPU):
    """Megatron's group layout: tensor-parallel peers are adjacent ranks, data-parallel groups stride over them."""

    def __init__(self, tp: int) -> None:
        world = dist.get_world_size()
        self.tp = tp
        super().__init__([list(range(i, i + tp)) for i in range(0, world, tp)],
                         [list(range(j, world, tp)) for j in range(tp)])


def megatron_layout(steps: int = 3, tp: int = 2, ranks_per_node: int = 4) -> dict:
    """TP=tp on the world: ZeRO's DP group is a strict subgroup; TP peers hold different weights and
    data. Plain ZeRO-3, FCDP (node ∩ DP groups) and ZeRO++ hpZ (contiguous blocks) side by side, and
    FCDP with node gradient accumulation (node peers inside each DP group) against ZeRO-3 at GA 2."""
    setup(ranks_per_node)
    mpu = MiniMPU(tp)
    tp_rank = mpu.get_model_parallel_rank()
    import fcdp_deepspeed as fd
    fd.install()
    out = {}
    blocks = {"fcdp": fcdp_block(ranks_per_node), "fcdp_node_ga2": fcdp_block(ranks_per_node, grad_accumulation="node")}
    for name in ("plain", "fcdp", "hpz", "plain_ga2", "fcdp_node_ga2"):
        cfg = toy.ds_config(blocks.get(name), regime="large", hpz=ranks_per_node // tp if name == "hpz" else 0,
                            grad_accum=2 if name.endswith("_ga2") else 1)
        torch.manual_seed(100 + tp_rank)  # TP peers hold different values
        with deepspeed.zero.Init(config_dict_or_path=cfg, mpu=mpu, data_parallel_group=mpu.get_data_parallel_group()):
            model = toy.ToyModel(32, 4)
        try:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
            res = toy.train(engine, steps, seed=tp_rank)  # different data per TP rank too
            out[name] = {"losses": res.losses, "stats": res.stats}
        except Exception as err:  # noqa: BLE001 - hpZ may refuse this layout outright
            out[name] = {"error": f"{type(err).__name__}: {err}"}
            if name != "hpz":
                raise
    out["dp_ranks"] = mpu._dp_ranks
    return out
