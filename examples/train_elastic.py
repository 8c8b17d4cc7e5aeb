"""A plain DeepSpeed ZeRO-3 training script that survives restarts: it resumes from the latest
checkpoint and saves one every ``--save_interval`` steps. No FCDP code in it; the ``"fcdp"`` block
in the config is all it takes (see docs/reliability.md).

Under torchrun's elastic agent, one agent per node, a node whose ranks die is restarted and the job
goes on from the last checkpoint (``--save_dir`` must be a directory every node sees):

    DS_ACCELERATOR=cpu torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 \\
        --rdzv-backend c10d --rdzv-endpoint NODE0_ADDR:29400 --rdzv-id myjob \\
        examples/train_elastic.py --deepspeed_config configs/toy_fcdp.json \\
        --save_dir /shared/ckpt --steps 8 --save_interval 2

At another world size, convert the last checkpoint with DeepSpeed's universal checkpoint tool and
start the same script with ``"checkpoint": {"load_universal": true}`` in its config.

What makes it resumable (what a user's script needs):

1. ``engine.load_checkpoint(save_dir)`` right after ``deepspeed.initialize``: it follows the
   ``latest`` file and returns ``(None, None)`` before the first save;
2. the data position comes from the restored step (``engine.global_steps``): here each step's batch
   is drawn from its number; with a DataLoader, skip the batches already seen or keep the sampler's
   position in ``client_state``;
3. ``engine.save_checkpoint(save_dir)`` on every rank every ``save_interval`` steps, and after the last.
"""
import argparse
import json

import torch
import torch.nn.functional as F

import deepspeed


def build_model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
                                 for _ in range(4)])


def batch(step: int, rank: int, hidden: int) -> torch.Tensor:
    """The batch of one rank at one step: what an uninterrupted run would see at that step."""
    return torch.randn(4, hidden, generator=torch.Generator().manual_seed(1000 * rank + step))


def log(path: str, rank: int, record: dict) -> None:
    """Rank 0 appends one JSON line (the job's metrics, kept across restarts)."""
    if rank == 0 and path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--save_dir", required=True, help="checkpoint directory (shared by every node)")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps of the whole job")
    ap.add_argument("--save_interval", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--metrics", default=None, help="rank 0 appends a JSON line per start and per step here")
    ap.add_argument("--dist_backend", default="gloo")
    ap.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = ap.parse_args()

    deepspeed.init_distributed(dist_backend=args.dist_backend)
    model = build_model(args.hidden)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config)
    load_path, _ = engine.load_checkpoint(args.save_dir)  # (None, None) on a fresh start
    rank = deepspeed.comm.get_rank()
    start = engine.global_steps
    world = deepspeed.comm.get_world_size()
    if rank == 0:
        print(f"train_elastic: world {world}, resumed from {load_path} at step {start}", flush=True)
    log(args.metrics, rank, {"start": start, "resumed_from": load_path, "world": world})
    for step in range(start, args.steps):
        x = batch(step, rank, args.hidden)
        loss = F.mse_loss(engine(x), torch.sin(x))
        engine.backward(loss)
        engine.step()
        log(args.metrics, rank, {"step": step, "loss": loss.item(), "world": world})
        if (step + 1) % args.save_interval == 0 or step + 1 == args.steps:
            engine.save_checkpoint(args.save_dir)  # tag global_step<N>; `latest` names it
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
