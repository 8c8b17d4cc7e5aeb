"""A plain DeepSpeed ZeRO-3 training script with no FCDP code in it.

With fcdp-deepspeed installed, the ``"fcdp"`` block in the config is all it takes (the package's
startup hook installs FCDP when DeepSpeed is imported); without the block it is plain ZeRO-3:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 examples/train_toy.py --deepspeed_config configs/toy_fcdp.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 examples/train_toy.py --deepspeed_config configs/toy_fcdp.json

With the hook off (``FCDP_AUTOLOAD=0``), the module entry installs FCDP instead:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 -m fcdp_deepspeed.run examples/train_toy.py \\
        --deepspeed_config configs/toy_fcdp.json
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

import deepspeed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", default=None, help="rank 0 writes losses and engine facts here (JSON)")
    ap.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = ap.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    h = args.hidden
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Tanh()) for _ in range(4)])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config)
    losses = []
    rank = deepspeed.comm.get_rank()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(4, h, generator=g)
        loss = F.mse_loss(engine(x), torch.sin(x))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    facts = {"rank": rank, "losses": losses, "optimizer": type(engine.optimizer).__name__,
             "model_bytes": sum(p.ds_numel * 4 for p in engine.module.parameters()),
             "launcher_env": {k: os.environ.get(k) for k in ("CROSS_RANK", "LOCAL_SIZE", "GROUP_RANK")}}
    try:
        import fcdp_deepspeed  # only to report; the script itself never needs it
        stats = fcdp_deepspeed.get_stats(engine)
        facts.update({k: stats.get(k) for k in ("inter_node_allgather_bytes", "cache_hits", "num_nodes",
                                                "ranks_per_node", "node_ranks", "inter_node_grad_reduce_bytes",
                                                "grad_accumulated", "grad_delivered", "diloco_syncs",
                                                "diloco_steps", "inter_node_diloco_bytes")})
    except ImportError:
        pass
    gathered = [None] * deepspeed.comm.get_world_size()
    deepspeed.comm.all_gather_object(gathered, facts)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
