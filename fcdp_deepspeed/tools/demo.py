"""Demo: train a toy model with plain ZeRO-3 and with FCDP on 4 CPU ranks (2 simulated nodes x 2)
and print the inter-node all-gather bytes of each.

    python -m fcdp_deepspeed.tools.demo [--steps 5] [--hidden 256]
"""
from __future__ import annotations

import argparse

import torch

from fcdp_deepspeed.tools.launch import run_local


def rank_main(steps: int, hidden: int, layers: int) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    import fcdp_deepspeed
    from fcdp_deepspeed.tools import toy

    deepspeed.init_distributed(dist_backend="gloo")
    fcdp_deepspeed.enable_comm_counting(ranks_per_node=2)
    out = {}
    for job, lora_rank in (("full fine-tune", 0), ("LoRA (frozen base)", 4)):
        for mode in ("ZeRO-3", "FCDP"):
            block = {"enabled": True, "ranks_per_node": 2} if mode == "FCDP" else None
            engine = toy.build_engine(toy.ds_config(block, regime="large"), hidden=hidden, layers=layers,
                                      lora_rank=lora_rank)
            res = toy.train(engine, steps, hidden=hidden, record_step_stats=True)
            per_step = [b["inter_node_allgather_bytes"] - a["inter_node_allgather_bytes"]
                        for a, b in zip(res.step_stats, res.step_stats[1:])]
            out[(job, mode)] = {"losses": res.losses, "inter_per_step": sum(per_step) / max(1, len(per_step)),
                                "intra": res.stats["intra_node_allgather_bytes"], "hits": res.stats["cache_hits"],
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
          f"(large-model release regime), {args.steps} steps each ...", flush=True)
    res = run_local("fcdp_deepspeed.tools.demo:rank_main", 4,
                    dict(steps=args.steps, hidden=args.hidden, layers=args.layers), timeout=900)[0]
    print(f"\n{'job':<20} {'engine':<8} {'inter-node allgather/step':>26} {'vs ZeRO-3':>10} {'same losses+weights':>20}")
    for job in ("full fine-tune", "LoRA (frozen base)"):
        base = res[(job, "ZeRO-3")]
        for mode in ("ZeRO-3", "FCDP"):
            r = res[(job, mode)]
            same = r["losses"] == base["losses"] and all(
                torch.equal(r["weights"][k], base["weights"][k]) for k in base["weights"])
            ratio = r["inter_per_step"] / base["inter_per_step"] if base["inter_per_step"] else float("nan")
            print(f"{job:<20} {mode:<8} {r['inter_per_step'] / 2**10:>21.1f} KiB {ratio:>10.3f} {str(same):>20}")
    print("\n(bytes each rank received from the other node in all-gathers, averaged over steps 2..N)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
