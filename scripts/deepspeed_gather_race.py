"""Plain ZeRO-3 (no FCDP): does ``deepspeed.zero.GatheredParameters`` return every parameter's true value?

Four gloo ranks on the CPU accelerator partition a small MLP with ZeRO-3 and gather all of its
parameters ``--iters`` times; each gather is compared with the weights the model had before
partitioning. Prints the number of gathers that returned a wrong value.

[Note: DeepSpeed 0.16.9-0.18.9 ``Init._allgather_params_coalesced`` (the blocking path behind
``GatheredParameters`` of more than one parameter) waits only on the LAST of its async all-gathers;
on the CPU accelerator gloo runs them on several threads and ``synchronize()`` is skipped, so the
earlier parameters can be read before their all-gather finished. 0.19.8 waits on every handle.]

Usage: DS_ACCELERATOR=cpu python scripts/deepspeed_gather_race.py [--iters 200] [--wait-each]
  --wait-each: wait on every all-gather as it is issued (shows the missing waits are the cause).
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, iters: int, wait_each: bool, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    from deepspeed import comm as dist
    deepspeed.init_distributed(dist_backend="gloo")
    if wait_each:
        issue = dist.all_gather_into_tensor

        def all_gather_into_tensor(*args, **kwargs):
            handle = issue(*args, **kwargs)
            if handle is not None:
                handle.wait()
            return handle

        dist.all_gather_into_tensor = all_gather_into_tensor
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    expected = copy.deepcopy(model.state_dict())
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    named = list(engine.module.named_parameters())
    wrong = 0
    for _ in range(iters):
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            wrong += any(not torch.equal(p.data, expected[n]) for n, p in named)
    total = torch.tensor([wrong])
    dist.all_reduce(total)
    if rank == 0:
        print(f"deepspeed {deepspeed.__version__}: {int(total)} of {iters * world} gathers (all ranks) returned a "
              f"wrong value{' (wait-each)' if wait_each else ''}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--wait-each", action="store_true")
    parser.add_argument("--port", type=int, default=29631)
    a = parser.parse_args()
    mp.spawn(rank_main, args=(4, a.iters, a.wait_each, a.port), nprocs=4)
