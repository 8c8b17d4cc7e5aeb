"""The GPU check's case h: four real ranks on one GPU, 2 emulated nodes x 2, through the real ``deepspeed.initialize``.

Four processes share the GPU, each with its own CUDA context, on the gloo backend with CUDA tensors (gloo's CUDA
collectives where it has them, the pinned-host staging of ``staging.py`` where it does not: :func:`one_gpu_rank`
records which). So the real engine runs with real streams, events, pinned host slots and the caching allocator, and
values are checked across real processes:

- ``flat`` (``grad_reduce: flat``, ``grad_accumulation: rank``), ``ahead`` (the run-ahead on streams) and ``lora``
  (a LoRA job against ZeRO-3's LoRA job): losses bit-identical to ZeRO-3;
- ``defaults`` (the block's defaults, the link declared slow): within 1e-5 of ZeRO-3 (the summation order moves);
- ``int4`` (both codecs, lossy): every rank's replica equal, as an evaluation forward of one input on every rank;
- ``diloco`` (H = 2): after the last sync the two nodes' replicas equal, the same way;
- a checkpoint of ``flat`` saved and loaded into a fresh engine: the same weights and the same next loss.

- ``sanitized`` (last: the sanitizer stays on once enabled): the defaults with ``param_gather: flat`` ([Note: the
  sanitizer and the two-stage gather] in ``sanitizer.py``) under PyTorch's CUDA sanitizer in every rank: the
  gradient stages in flight and their workspace (``grads/workspace.py``) on real streams; no report may name FCDP's
  code, and its losses stay within 1e-5 of ZeRO-3's.

A dry run (``dry_run=True``) runs the same on the CPU accelerator with every collective staged (``force``), so CI
exercises the staging logic too (the sanitized variant without the sanitizer).
"""
from __future__ import annotations

import gc
import hashlib
import os
import tempfile
import time

import torch

from fcdp_lab.gpu import staging
from fcdp_lab.gpu.report import CaseResult
from fcdp_lab.gpu.sanitizer import fcdp_frames


def _replica_digest(engine, hidden: int) -> str:
    """An evaluation forward of one input (the same on every rank) through the engine's own fetch path."""
    from fcdp_lab.harness import toy
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4, hidden, generator=g).to(engine.device)
    out = toy.evaluate(engine, x).cpu()
    return hashlib.sha256(out.numpy().tobytes()).hexdigest()


def one_gpu_rank(hidden: int, layers: int, steps: int, dry_run: bool = False, ckpt_root: str = "") -> dict:
    """One of the four ranks: the variants' losses, replica digests and times, and what gloo ran natively."""
    import torch.distributed as tdist

    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    from fcdp_lab.harness import toy

    if not dry_run:
        # every rank on the one GPU: DeepSpeed's engine and zero.Init read LOCAL_RANK for their device
        os.environ["LOCAL_RANK"] = "0"
        get_accelerator().set_device(0)
    tdist.init_process_group("gloo")
    world = tdist.get_world_size()
    device = torch.device("cpu" if dry_run else "cuda:0")
    native = staging.probe(device, world)
    staged = staging.install(native, force=dry_run)  # before DeepSpeed binds its collectives
    deepspeed.init_distributed(dist_backend="gloo")

    node = lambda **kw: {"enabled": True, "ranks_per_node": 2, "link": "slow", **kw}  # noqa: E731
    flat = {"grad_reduce": "flat", "grad_accumulation": "rank"}
    variants = {"zero3": (None, 0), "flat": (node(**flat), 0), "ahead": (node(param_runahead_streams=True, **flat), 0),
                "defaults": (node(), 0), "zero3_lora": (None, 2), "lora": (node(**flat), 2),
                "int4": (node(param_compression="int4", grad_compression="int4"), 0),
                "diloco": ({"enabled": True, "ranks_per_node": 2, "diloco": {"sync_every": 2}}, 0),
                "sanitized": (node(param_gather="flat"), 0)}
    out: dict = {"native": native, "staged": staged, "runs": {}}
    n_steps = max(steps, 4) // 2 * 2  # whole DiLoCo syncs
    for name, (block, lora) in variants.items():
        t0 = time.perf_counter()
        if name == "sanitized" and not dry_run:
            from torch.cuda._sanitizer import cuda_sanitizer, enable_cuda_sanitizer
            if not cuda_sanitizer.enabled:
                enable_cuda_sanitizer()
        try:
            engine = toy.build_engine(toy.ds_config(block, regime="large", micro_batch=8), hidden=hidden,
                                      layers=layers, lora_rank=lora)
            run = toy.train(engine, n_steps, hidden=hidden)
            get_accelerator().synchronize()
        except Exception as exc:  # the sanitizer's report (or anything else): kept whole, the other ranks go on
            if name != "sanitized":
                raise
            from fcdp_lab.gpu.sanitizer import error_text
            out["runs"][name] = {"losses": [], "digest": "", "seconds": time.perf_counter() - t0,
                                 "error": error_text(exc)}
            continue
        rec = {"losses": run.losses, "digest": _replica_digest(engine, hidden),
               "seconds": time.perf_counter() - t0, "error": ""}
        if name == "flat":
            rec["checkpoint"] = _round_trip(engine, hidden, layers, block, ckpt_root)
        out["runs"][name] = rec
        del engine, run
        gc.collect()  # four processes share the GPU: free each engine's buckets before the next
        get_accelerator().empty_cache()
    dist.barrier()
    return out


def _round_trip(engine, hidden: int, layers: int, block: dict, root: str) -> dict:
    """Save, load into a fresh engine, compare weights and the next step's loss."""
    from deepspeed import comm as dist
    from fcdp_lab.harness import toy

    path = os.path.join(root or tempfile.gettempdir(), "one_gpu_ckpt")
    engine.save_checkpoint(path, tag="t")
    before = toy.gather_weights(engine)
    fresh = toy.build_engine(toy.ds_config(block, regime="large", micro_batch=8), hidden=hidden, layers=layers, seed=7)
    fresh.load_checkpoint(path, tag="t")
    after = toy.gather_weights(fresh)
    same_weights = all(torch.equal(before[k], after[k]) for k in before)
    next_a = toy.train(engine, 1, hidden=hidden, seed=5).losses
    next_b = toy.train(fresh, 1, hidden=hidden, seed=5).losses
    dist.barrier()
    return {"same_weights": same_weights, "same_next_loss": next_a == next_b}


def one_gpu_case(results: list[dict], dry_run: bool) -> CaseResult:
    """Compare the four ranks' runs (see the module docstring)."""
    res = CaseResult("h_one_gpu_ranks")
    res.numbers.update(world=len(results), native=results[0]["native"], staged=results[0]["staged"],
                       seconds_by_variant={n: round(r["seconds"], 2) for n, r in results[0]["runs"].items()})
    res.check("every rank found the same native collectives", all(r["native"] == results[0]["native"] for r in results))

    def rel(a: list, b: list) -> float:
        return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)

    for r, out in enumerate(results):
        runs = out["runs"]
        for name in ("flat", "ahead"):
            res.check(f"rank {r} {name}: losses bit-identical to ZeRO-3", runs[name]["losses"] == runs["zero3"]["losses"])
        res.check(f"rank {r} lora: losses bit-identical to ZeRO-3's LoRA", runs["lora"]["losses"] == runs["zero3_lora"]["losses"])
        err = rel(runs["defaults"]["losses"], runs["zero3"]["losses"])
        res.check(f"rank {r} defaults: losses within 1e-5 of ZeRO-3", err <= 1e-5, f"max rel {err:.2e}")
        ck = runs["flat"]["checkpoint"]
        res.check(f"rank {r}: checkpoint round trip keeps the weights and the next loss",
                  ck["same_weights"] and ck["same_next_loss"], str(ck))
        sanitized = runs["sanitized"]
        frames = fcdp_frames(sanitized["error"])
        res.check(f"rank {r} sanitized: no stream race in FCDP's code (CUDA sanitizer)", not frames,
                  "; ".join(frames[:4]) or sanitized["error"][:300] or ("CPU accelerator: no CUDA streams to sanitize"
                                                                         if dry_run else ""), not dry_run)
        if not sanitized["error"]:
            err = rel(sanitized["losses"], runs["zero3"]["losses"])
            res.check(f"rank {r} sanitized: losses within 1e-5 of ZeRO-3", err <= 1e-5, f"max rel {err:.2e}")
    res.numbers["sanitizer_errors"] = {r: out["runs"]["sanitized"]["error"][:4000] for r, out in enumerate(results)
                                       if out["runs"]["sanitized"]["error"]}
    for name in ("int4", "diloco", "flat"):
        digests = {out["runs"][name]["digest"] for out in results}
        res.check(f"{name}: every rank's replica equal (one input's forward)", len(digests) == 1, f"{len(digests)} distinct")
    return res
