"""Run a Megatron-DeepSpeed training script unchanged and record what the check compares.

    torchrun --nproc_per_node 4 scripts/megatron_probe.py pretrain_gpt.py ARGS...                        # ZeRO-3
    torchrun --nproc_per_node 4 -m fcdp_deepspeed.run scripts/megatron_probe.py pretrain_gpt.py ARGS...  # FCDP
    python scripts/megatron_probe.py --install pretrain_gpt.py ARGS...   # = an `fcdp_deepspeed.install()` line

The probe does not install FCDP itself (unless ``--install``): whichever way the job was launched
decides. It wraps ``deepspeed.initialize`` (to count collectives by link class with
``fcdp_deepspeed.enable_comm_counting``, using the ``fcdp.ranks_per_node`` of the job's DeepSpeed
config, and to keep the engine) and Megatron's ``training_log`` (to record every iteration's exact
``lm loss`` and grad norm), runs the script as ``__main__``, then gathers the final weights and
writes ``$FCDP_MEGATRON_OUT/rank<R>.json``. That file is written only after training completed,
so the caller judges success by it, not by the exit status (gloo ranks can abort at exit).
"""
from __future__ import annotations

import hashlib
import json
import os
import runpy
import sys
import time


def _ranks_per_node(config) -> int | None:
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    block = (config or {}).get("fcdp") or {}
    return block.get("ranks_per_node")


def main() -> None:
    argv = sys.argv[1:]
    install = bool(argv) and argv[0] == "--install"
    if install:
        argv = argv[1:]
    if not argv:
        raise SystemExit(__doc__)
    # `deepspeed --module fcdp_deepspeed.run probe.py ...` hands us --local_rank first; pass it on.
    launcher_args = []
    while argv and argv[0].startswith(("--local_rank", "--local-rank")):
        launcher_args.append(argv.pop(0))
    script, script_args = os.path.abspath(argv[0]), [*launcher_args, *argv[1:]]
    out_dir = os.environ["FCDP_MEGATRON_OUT"]
    sys.path.insert(0, os.path.dirname(script))  # as `python pretrain_gpt.py` does

    import torch
    import deepspeed
    import fcdp_deepspeed
    if install:
        fcdp_deepspeed.install()
    import megatron.training as mtraining

    state: dict = {"engine": None, "steps": [], "bytes_at_init": 0}
    original_initialize = deepspeed.initialize

    def initialize(*args, **kwargs):
        config = kwargs.get("config") or kwargs.get("config_params")
        if config is None and kwargs.get("args") is not None:
            config = getattr(kwargs["args"], "deepspeed_config", None)
        fcdp_deepspeed.enable_comm_counting(_ranks_per_node(config))
        result = original_initialize(*args, **kwargs)
        state["engine"] = result[0]
        # The zero point of the per-step bytes: what was counted before training started.
        state["bytes_at_init"] = fcdp_deepspeed.get_stats(result[0])["inter_node_allgather_bytes"]
        return result

    deepspeed.initialize = initialize

    original_training_log = mtraining.training_log

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs):
        loss = loss_dict.get("lm loss")
        loss = float(loss.item() if torch.is_tensor(loss) else loss) if loss is not None else float("nan")
        engine = state["engine"]
        if grad_norm is None and engine is not None:  # Megatron passes None under DeepSpeed
            grad_norm = engine.get_global_grad_norm()
        gn = float(grad_norm) if grad_norm is not None else float("nan")
        stats = fcdp_deepspeed.get_stats(engine) if engine is not None else {}
        state["steps"].append({"iteration": iteration, "loss": loss, "loss_hex": loss.hex(),
                               "grad_norm_hex": gn.hex(), "lr": learning_rate, "skipped": int(skipped_iter),
                               "inter_node_allgather_bytes": stats.get("inter_node_allgather_bytes"),
                               "inter_node_grad_reduce_bytes": stats.get("inter_node_grad_reduce_bytes"),
                               "time": time.time()})
        return original_training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                                     report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)

    mtraining.training_log = training_log

    t0 = time.time()
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")
    t_end = time.time()

    engine = state["engine"]
    if engine is None:
        raise SystemExit("megatron_probe: deepspeed.initialize was never called")
    stats = fcdp_deepspeed.get_stats(engine)
    # Full (gathered) weights of this rank's model-parallel shard, in parameter order on every rank.
    digests = {}
    weights = {}  # the tensors too: runs with gradient modes are compared within a tolerance
    whole = hashlib.sha256()
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            data = param.detach().cpu().contiguous().clone()
            h = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        digests[name] = h
        weights[name] = data
        whole.update(name.encode() + h.encode())
    rank = torch.distributed.get_rank()
    torch.save(weights, os.path.join(out_dir, f"weights{rank}.pt"))
    steps = state["steps"]
    result = {
        "rank": rank,
        "world_size": torch.distributed.get_world_size(),
        "fcdp_enabled": bool(stats.get("fcdp_enabled")) and getattr(engine.optimizer, "fcdp", None) is not None,
        "fcdp_installed": fcdp_deepspeed.is_installed(),
        "steps": steps,
        "inter_node_allgather_bytes_at_init": state["bytes_at_init"],
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool)) or v is None},
        "weights_sha256": whole.hexdigest(),
        "param_sha256": digests,
        "total_seconds": t_end - t0,
        # From the first logged iteration to the end of pretrain(): the training loop, one step short.
        "train_seconds": t_end - (steps[0]["time"] if steps else t0),
    }
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"megatron_probe: rank {rank} wrote {path}", flush=True)


if __name__ == "__main__":
    main()
