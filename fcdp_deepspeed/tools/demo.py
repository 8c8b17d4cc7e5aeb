"""Demo: train a toy model with plain ZeRO-3 and with FCDP on 4 CPU ranks (2 simulated nodes x 2)
and print what each sends between the nodes per optimizer step.

    python -m fcdp_deepspeed.tools.demo [--steps 5] [--hidden 256]

Jobs: full fine-tune, LoRA, and full fine-tune with gradient accumulation over 4 micro-steps. "FCDP" is
the defaults (``"fcdp": {"enabled": true}``: node cache, two-stage parameter gather, hierarchical
gradient reduction and node accumulation), so gradients cross nodes once per optimizer step and their
summation order differs from ZeRO-3 (the demo prints the largest relative loss difference); "FCDP exact"
keeps DeepSpeed's gradient path (``grad_reduce: flat``, ``grad_accumulation: rank``) and is
bit-identical to ZeRO-3.
"""
from __future__ import annotations

import argparse

import torch

from fcdp_deepspeed.tools.launch import run_local

#: (job, LoRA rank, gradient accumulation, engines: name -> extra fcdp keys or None for ZeRO-3)
#: "FCDP" is the defaults; "FCDP exact" keeps DeepSpeed's gradient path (bit-identical to ZeRO-3).
ZERO3_GRADS = {"grad_reduce": "flat", "grad_accumulation": "rank"}
JOBS = (
    ("full fine-tune", 0, 1, {"ZeRO-3": None, "FCDP exact": ZERO3_GRADS, "FCDP": {}}),
    ("LoRA (frozen base)", 4, 1, {"ZeRO-3": None, "FCDP exact": ZERO3_GRADS, "FCDP": {}}),
    ("full, GA 4", 0, 4, {"ZeRO-3": None, "FCDP exact": ZERO3_GRADS, "FCDP": {}}),
)
KEYS = ("inter_node_allgather_bytes", "inter_node_grad_reduce_bytes")


def rank_main(steps: int, hidden: int, layers: int) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    import fcdp_deepspeed
    from fcdp_deepspeed.tools import toy

    deepspeed.init_distributed(dist_backend="gloo")
    fcdp_deepspeed.enable_comm_counting(ranks_per_node=2)
    out = {}
    for job, lora_rank, ga, engines in JOBS:
        for mode, extra in engines.items():
            block = {"enabled": True, "ranks_per_node": 2, **extra} if extra is not None else None
            engine = toy.build_engine(toy.ds_config(block, regime="large", grad_accum=ga), hidden=hidden,
                                      layers=layers, lora_rank=lora_rank)
            res = toy.train(engine, steps, hidden=hidden, record_step_stats=True)
            per_step = {k: sum(b[k] - a[k] for a, b in zip(res.step_stats, res.step_stats[1:])) / max(1, steps - 1)
                        for k in KEYS}
            out[(job, mode)] = {"losses": res.losses, "per_step": per_step,
                                "weights": toy.gather_weights(engine)}  # collective on every rank
    if dist.get_rank() != 0:
        for v in out.values():
            v["weights"] = None  # rank 0 reports
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    print(f"Training a {args.layers}-layer toy model on 4 CPU ranks = 2 simulated nodes x 2 ranks "
          f"(large-model release regime), {args.steps} optimizer steps each ...", flush=True)
    res = run_local("fcdp_deepspeed.tools.demo:rank_main", 4,
                    dict(steps=args.steps, hidden=args.hidden, layers=args.layers), timeout=1200)[0]
    print(f"\n{'job':<20} {'engine':<11} {'all-gather/step':>16} {'grad reduce/step':>17} {'total vs ZeRO-3':>16} "
          f"{'vs ZeRO-3 losses, weights':>26}")
    for job, _, _, engines in JOBS:
        base = res[(job, "ZeRO-3")]
        base_total = sum(base["per_step"].values())
        for mode in engines:
            r = res[(job, mode)]
            if r["losses"] == base["losses"] and all(torch.equal(r["weights"][k], base["weights"][k])
                                                     for k in base["weights"]):
                same = "bit-identical"
            else:
                same = f"max rel diff {max(abs(a - b) / abs(b) for a, b in zip(r['losses'], base['losses'])):.1e}"
            total = sum(r["per_step"].values())
            print(f"{job:<20} {mode:<11} {r['per_step'][KEYS[0]] / 2**10:>12.1f} KiB "
                  f"{r['per_step'][KEYS[1]] / 2**10:>13.1f} KiB {total / base_total:>16.3f} {same:>26}")
    print("\n(bytes each rank received over inter-node collectives per optimizer step, averaged over steps 2..N;\n"
          " FCDP = the defaults; FCDP exact = grad_reduce \"flat\", grad_accumulation \"rank\")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
