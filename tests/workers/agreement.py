"""Rank workers of test_agreement.py: every rank issues the same collectives in the same order.

(a) a fetch mixing batched-refill hits with misses the two-stage gather does not serve (a parameter
partitioned over an expert-data-parallel group, as DeepSpeed-MoE/AutoEP experts are);
(b) data-parallel groups of different shapes in one job (groups are created on every rank alike).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import deepspeed
from deepspeed import comm as dist
from deepspeed.runtime.torch_autocast import PARAM_COMM_DTYPE_ATTR_NAME
from deepspeed.runtime.zero.partition_parameters import get_allgather_dtype
from deepspeed.utils import groups

import fcdp_deepspeed
from fcdp_lab.harness import toy
from workers.common import GroupMPU, fcdp_block, setup

#: Expert-parallel size of the MoE-like parameters: experts {0,1} | {2,3}, expert-DP groups {0,2} | {1,3}.
EP_SIZE = 2


#: Elements of the frozen gain: below ``MIN_NUMEL``, so FCDP never caches it (a miss at every fetch).
GAIN_NUMEL = 16
MIN_NUMEL = 32


class ExpertBlock(toy.Block):
    """A toy block whose own parameters (fetched together) are LoRA adapters (cached: the batched refill
    serves them after a step), an "expert" weight partitioned over the expert-data-parallel group the way
    DeepSpeed partitions AutoEP experts (``ds_zero_partition_process_group`` set before ``zero.Init``
    converts it, ``engine._partition_autoep_zero3_experts``; each expert-parallel rank holds its own
    expert), and a frozen gain with a bf16 communication dtype, marked as ``torch_autocast`` marks the
    parameters of a lower-precision-safe module (``init_autocast_params``). The two-stage gather serves
    neither of the last two."""

    def __init__(self, hidden: int, lora_rank: int, expert_group, ep_rank: int) -> None:
        super().__init__(hidden, lora_rank)
        g = torch.Generator().manual_seed(100 + ep_rank)
        self.expert = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.02)
        self.expert.ds_zero_partition_process_group = expert_group
        self.gain = torch.nn.Parameter(1 + torch.randn(GAIN_NUMEL, generator=g) * 0.1, requires_grad=False)
        setattr(self.gain, PARAM_COMM_DTYPE_ATTR_NAME, torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x) + F.linear(x, self.expert)
        return y * self.gain.repeat(y.shape[-1] // GAIN_NUMEL)


class ExpertToy(toy.ToyModel):
    def __init__(self, hidden: int, layers: int, lora_rank: int, expert_group, ep_rank: int) -> None:
        super().__init__(hidden, layers, lora_rank)
        self.blocks = torch.nn.ModuleList(ExpertBlock(hidden, lora_rank, expert_group, ep_rank) for _ in range(layers))
        for name, p in self.named_parameters():  # the adapters and the experts train, the base is frozen
            p.requires_grad = "lora_" in name or "expert" in name


def _expert_engine(cfg: dict, layers: int):
    fcdp_deepspeed.install()
    name = f"ep_size_{EP_SIZE}"
    if name not in groups._get_expert_data_parallel_group_dict():
        groups._create_expert_and_data_parallel(EP_SIZE)  # collective over the world, once per job
    ep_rank = dist.get_rank(group=groups._get_expert_parallel_group(name))
    torch.manual_seed(0)
    model = ExpertToy(32, layers, 2, groups._get_expert_data_parallel_group(name), ep_rank)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=copy.deepcopy(cfg))
    return engine


def _mixed_fetch(engine) -> dict:
    """One fetch of the first block's own parameters after a step (adapters stale: the batched refill runs
    and turns them into hits), in a different order on every rank, as the coordinator's set may hand
    them: every value must equal DeepSpeed's flat gather of its partitions over its own group."""
    block = engine.module.blocks[0]
    params = [block.lora_a, block.lora_b, block.gain, block.expert]
    shift = dist.get_rank() % len(params)
    order = params[shift:] + params[:shift]
    order[0].all_gather_coalesced(order).wait()
    exact = {}
    for name, p in (("lora_a", block.lora_a), ("lora_b", block.lora_b), ("gain", block.gain), ("expert", block.expert)):
        world = dist.get_world_size(group=p.ds_process_group)
        ref = torch.empty(p.ds_tensor.numel() * world, dtype=p.ds_tensor.dtype)
        dist.all_gather_into_tensor(ref, p.ds_tensor.data, group=p.ds_process_group)
        ref = ref[:p.ds_numel].to(get_allgather_dtype(p, p.ds_tensor)).to(p.dtype)
        exact[name] = torch.equal(p.data.reshape(-1), ref)
    for p in params:
        p.partition()
    return exact


def expert_refill(steps: int = 2, layers: int = 2) -> dict:
    """LoRA + expert + autocast-dtype parameters through ``deepspeed.initialize``, large release regime:
    plain ZeRO-3 and FCDP (ZeRO-3's gradient sums, batched refill on): losses, weights,
    stats; then a fetch mixing refilled hits with both kinds of unsupported misses, in rank-dependent
    order, and an eval forward on both engines."""
    setup(2)
    out = {}
    for name in ("plain", "fcdp"):
        cfg = toy.ds_config(fcdp_block(2, min_numel=MIN_NUMEL) if name == "fcdp" else None,
                            regime="large")
        engine = _expert_engine(cfg, layers)
        res = toy.train(engine, steps)
        exact = _mixed_fetch(engine)
        evaluated = toy.evaluate(engine, torch.randn(2, 32, generator=torch.Generator().manual_seed(7)))
        weights = toy.gather_weights(engine)
        out[name] = {"losses": res.losses, "weights": weights, "stats": fcdp_deepspeed.get_stats(engine),
                     "optimizer": type(engine.optimizer).__name__, "exact": exact, "eval": evaluated}
    return out


class StageMPU(GroupMPU):
    """Data-parallel groups of different shapes in one job (as pipeline stages spread over different numbers of
    nodes): ``dp_groups`` partitions the world, tensor parallelism is 1 (a group of one per rank)."""

    def __init__(self, dp_groups: list[list[int]]) -> None:
        super().__init__([[r] for r in range(dist.get_world_size())], dp_groups)


def _world_group_works() -> bool:
    """A group over every rank, created after the engines, reduces: every rank created the same number of
    groups before it (torch names a group by a per-rank counter of ``new_group`` calls, so a rank that
    skipped one would look for the new group under another name, and hang)."""
    check = dist.new_group(list(range(dist.get_world_size())))
    one = torch.ones(1)
    dist.all_reduce(one, group=check)
    return int(one.item()) == dist.get_world_size()


def uneven_dp(dp_groups: list[list[int]], steps: int = 1, grad_accum: int = 2, modes: dict | None = None) -> dict:
    """DP groups of different shapes (e.g. {0,1,2,3} on 2 nodes x 2, {4,5} on one node): each rank's group
    trains its own toy model (as a pipeline stage would), with plain ZeRO-3 and with FCDP's defaults
    (node-peer groups for the two-stage gather and the gradient modes where the group spans nodes); losses,
    this rank's weights, the resolved modes, and whether a world group made afterwards works. ``modes``:
    fcdp keys over the defaults (e.g. ``param_gather: flat`` leaves only the gradient modes' groups)."""
    setup(2)
    mpu = StageMPU(dp_groups)
    fcdp_deepspeed.install()
    seed = next(i for i, g in enumerate(dp_groups) if dist.get_rank() in g)
    out = {}
    for name in ("plain", "fcdp"):
        block = {"enabled": True, "ranks_per_node": 2, **(modes or {})}
        cfg = toy.ds_config(block if name == "fcdp" else None, regime="large",
                            grad_accum=grad_accum)
        torch.manual_seed(seed)
        model = toy.ToyModel(32, 2)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
        groups_agree = _world_group_works()
        res = toy.train(engine, steps)
        stats = fcdp_deepspeed.get_stats(engine)
        out[name] = {"losses": res.losses, "weights": toy.gather_weights(engine), "groups_agree": groups_agree,
                     "optimizer": type(engine.optimizer).__name__,
                     **{k: stats.get(k) for k in ("param_gather", "grad_reduce", "grad_accumulation")}}
    return out
