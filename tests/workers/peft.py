"""Workers of test_peft.py: a LoRA-style model (frozen base) with plain ZeRO-3 and FCDP."""
from __future__ import annotations

import torch
from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_lab.harness import toy
from workers.common import fcdp_block, setup


def _inter(engine) -> int:
    return fcdp_deepspeed.get_stats(engine)["inter_node_allgather_bytes"]


def peft_traffic(steps: int = 4, hidden: int = 256, lora_rank: int = 1, grad_accum: int = 1) -> dict:
    """LoRA-style model (frozen base), plain vs FCDP: per-step traffic, then two evals after training."""
    setup()
    out = {}
    for mode in ("plain", "fcdp"):
        cfg = toy.ds_config(fcdp_block() if mode == "fcdp" else None, regime="large", grad_accum=grad_accum)
        engine = toy.build_engine(cfg, hidden=hidden, lora_rank=lora_rank)
        res = toy.train(engine, steps, hidden=hidden, record_step_stats=True, record_phases=True)
        x_eval = torch.randn(2, hidden, generator=torch.Generator().manual_seed(123))
        evals = []
        for _ in range(2):
            before = _inter(engine)
            output = toy.evaluate(engine, x_eval)
            evals.append({"inter": _inter(engine) - before, "output": output})
        res.stats = fcdp_deepspeed.get_stats(engine)
        weights = toy.gather_weights(engine)
        res.weights = {k: v for k, v in weights.items() if "lora_" in k} if dist.get_rank() == 0 else {}
        res.extra["evals"] = evals
        res.extra["trainable_numel"] = sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad)
        out[mode] = res
    return out
