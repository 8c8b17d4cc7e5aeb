"""Workers of test_parity.py: plain ZeRO-3 vs FCDP on scenarios, edge parameters, prefetch soak."""
from __future__ import annotations

import torch

import deepspeed
from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_lab.harness import toy
from workers.common import DTYPES, fcdp_block, forward, run_scenario, setup


def parity(scenarios: list[dict], ranks_per_node: int = 2) -> dict:
    """Every scenario twice, plain ZeRO-3 then FCDP, in one process group."""
    setup(ranks_per_node)
    return {sc["name"]: {mode: run_scenario(sc, mode == "fcdp", ranks_per_node) for mode in ("plain", "fcdp")}
            for sc in scenarios}


class EdgeModel(torch.nn.Module):
    """Parameters FCDP must survive: tiny (< L elements), sizes not divisible by L, zero-size, tied
    weights used by two modules, a module reused twice, and an external parameter."""

    def __init__(self, hidden: int = 30, zero_size: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(hidden, hidden)  # 30x30 + 30: not divisible by 4
        self.tiny = torch.nn.Linear(hidden, 1)  # bias of 1 element (< L)
        self.back = torch.nn.Linear(1, hidden, bias=False)
        self.shared = torch.nn.Linear(hidden, hidden)  # called twice per forward
        self.head = torch.nn.Linear(hidden, hidden, bias=False)
        self.head.weight = self.emb.weight  # tied with emb
        self.empty = torch.nn.Parameter(torch.empty(0)) if zero_size else None  # zero-size
        self.ext = torch.nn.Linear(hidden, hidden)
        self.gate = torch.nn.Linear(hidden, hidden, bias=False)  # never called: its weight is used by
        # the parent's forward, i.e. external to its owner (registered after partitioning)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x))
        h = h + self.back(torch.tanh(self.tiny(h)))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h)) + 0.1 * torch.nn.functional.linear(h, self.gate.weight)
        out = self.head(h + self.ext(h))
        return out + self.empty.sum() if self.empty is not None else out


def edge_parameters(steps: int = 4, persistence_threshold: int = 0, dtype: str = "fp32", zero_size: bool = False,
                    modes: tuple = ("plain", "fcdp")) -> dict:
    setup()
    out = {}
    import fcdp_deepspeed as fd
    fd.install()
    for mode in modes:
        cfg = toy.ds_config(fcdp_block() if mode == "fcdp" else None, regime="large", dtype=dtype,
                            stage3_param_persistence_threshold=persistence_threshold)
        torch.manual_seed(0)
        model = EdgeModel(zero_size=zero_size)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        deepspeed.zero.register_external_parameter(engine.module, engine.module.gate.weight)
        res = toy.train(engine, steps, hidden=30, dtype=DTYPES[dtype])
        res.weights = toy.gather_weights(engine)
        if dist.get_rank() != 0:
            res.weights = {}
        out[mode] = res
    return out


def prefetch_soak(steps: int = 20) -> dict:
    """DeepSpeed's prefetching on (buckets of several params), params released after use, many
    steps and GA 2: cache fills, prefetched hits and invalidations interleave; FCDP must stay
    identical to ZeRO-3 throughout."""
    setup()
    out = {}
    for name, zero, lora in (("prefetch_release", {"stage3_prefetch_bucket_size": 3000, "stage3_max_reuse_distance": 0}, 0),
                             ("deepspeed_defaults_lora", {}, 2)):
        sc = {"steps": steps, "regime": "default", "zero": zero, "lora_rank": lora, "grad_accum": 2}
        runs = {mode: run_scenario(sc, mode == "fcdp") for mode in ("plain", "fcdp")}
        out[name] = {"plain": runs["plain"].losses, "fcdp": runs["fcdp"].losses, "stats": runs["fcdp"].stats}
    return out



def after_hpz(steps: int = 3) -> dict:
    """In one process: a plain ZeRO-3 reference, a ZeRO++ hpZ engine (which leaves its group in a
    DeepSpeed module global), then FCDP engines on new, unpartitioned models (training, and
    optimizer-less, which DeepSpeed builds through a different call site)."""
    from deepspeed.utils import groups
    setup()
    out = {"plain": run_scenario({"steps": steps}, fcdp=False)}
    toy.train(toy.build_engine(toy.ds_config(regime="large", hpz=2)), 1)
    out["inherited_group"] = groups._get_zero_param_intra_parallel_group() is not None
    fcdp_engine = toy.build_engine(toy.ds_config(fcdp_block(), regime="large"))
    out["fcdp"] = toy.train(fcdp_engine, steps)
    out["fcdp"].weights = toy.gather_weights(fcdp_engine)
    torch.manual_seed(0)
    model = toy.ToyModel(32, 4).eval()
    with torch.no_grad():
        out["offload_reference"] = model(torch.randn(2, 32, generator=torch.Generator().manual_seed(7)))
    cfg = {k: v for k, v in toy.ds_config(fcdp_block(), regime="large").items() if k != "optimizer"}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    out["classes"] = [type(e.optimizer).__name__ for e in (fcdp_engine, engine)]
    out["offload"] = [forward(engine, 32) for _ in range(2)]  # the second forward is served by the cache
    out["offload_stats"] = fcdp_deepspeed.get_stats(engine)
    return out
