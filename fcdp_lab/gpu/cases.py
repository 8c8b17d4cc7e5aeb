"""Cases (a) and (c) of the GPU check: the host-buffer gradient flush on NCCL at world size 1, and
real NCCL on 4 or more GPUs (2 emulated nodes x L) against ZeRO-3 and ZeRO++ hpZ.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import asdict

import torch

from fcdp_lab.gpu.report import CaseResult, call_site

#: A host wait on the two-stage gather's stage 1 longer than this (median) is a stall: on NCCL ``wait()`` only
#: orders streams.
STAGE1_WAIT_US = 1000


def grad_flush_case(backend: str, numels: tuple[int, ...] = (4099, 37), micro_steps: int = 3) -> CaseResult:
    """World size 1. Every parameter gets a gradient in the first ``micro_steps - 1`` micro-steps; the
    last one gets none in the boundary micro-step, so its window sum leaves through ``flush``."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    from fcdp_deepspeed.config import parse_fcdp_config
    from fcdp_deepspeed.grads import GradReducer, build_layout
    from fcdp_lab.gpu import trace as gpu_trace

    res = CaseResult("a_grad_flush")
    acc = get_accelerator()
    acc.set_device(0)
    deepspeed.init_distributed(dist_backend=backend)
    device = torch.device(acc.current_device_name())
    group = dist.new_group([0])
    _warm_up_communicators(res, dist, backend)
    cfg = parse_fcdp_config({"fcdp": {"enabled": True, "ranks_per_node": 1, "grad_accumulation": "node",
                                      "grad_buffer_device": "host"}})
    boundary = [False]
    reducer = GradReducer(cfg, build_layout([0], {0: "node0"}, 0), group, group, group, torch.float32,
                          lambda: boundary[0])
    reducer.comm.use_alltoall = False  # reduce_scatter_tensor, NCCL's path, also on gloo in a dry run
    reducer.node_accumulation = True  # what build_reducer's resolved plan sets for grad_accumulation "node"
    params = []
    for ds_id, n in enumerate(numels):
        p = torch.nn.Parameter(torch.zeros(n, device=device))
        p.ds_id, p.ds_numel = ds_id, n
        params.append(p)
    reducer.plan_buffer(params)
    flat = reducer.buffer.flat
    res.numbers.update(backend=backend, device=str(device), buffer_bytes=reducer.buffer.nbytes)
    res.check("node buffer allocated on the host", flat is not None and flat.device.type == "cpu")
    res.check("node buffer pinned", flat is not None and flat.is_pinned(), applicable=device.type != "cpu")
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(n, generator=gen).to(device) for n in numels] for _ in range(micro_steps)]
    delivered: dict[int, torch.Tensor] = {}
    try:
        for m in range(micro_steps):
            boundary[0] = m == micro_steps - 1
            step_params = params[:-1] if boundary[0] else params
            with gpu_trace.traced(device.type == "cuda") as holder:  # numbers only: what each micro-step blocks on
                out = reducer.reduce(step_params, grads[m][:len(step_params)])
                reducer.advance(keep=0)  # the stages in flight (grads/inflight.py), as the backward's end takes them on
                pending = list(reducer.queue.take(0)) + (list(reducer.flush(torch.float32, bucket_numel=10**7))
                                                         if boundary[0] else [])
                for entry in pending:
                    delivered.update((p.ds_id, o) for p, o in zip(entry.params, reducer.complete(entry)))
            res.numbers.setdefault("trace", []).append(asdict(holder[0]))
            delivered.update((p.ds_id, o) for p, o in zip(step_params, out) if o.numel())
        acc.synchronize()
    except Exception as exc:  # e.g. NCCL refusing a host tensor: report where, keep the JSON
        res.check("boundary delivery and flush ran", False, call_site(exc))
        return res
    res.check("boundary delivery and flush ran", True)
    res.check("every window sum delivered", sorted(delivered) == list(range(len(params))), f"got {sorted(delivered)}")
    errors = []
    for i, n in enumerate(numels):
        got = delivered.get(i)
        window = micro_steps if i < len(numels) - 1 else micro_steps - 1
        ref = torch.zeros(n)
        for m in range(window):  # the reducer's order: zero buffer, + each micro-step
            ref = ref + grads[m][i].cpu()
        exact = sum(grads[m][i].cpu().double() for m in range(window))
        errors.append(None if got is None else float((got.cpu().double() - exact).abs().max()))
        res.check(f"param {i}: on the accelerator", got is not None and got.device == device)
        res.check(f"param {i}: equals the reference sum", got is not None and torch.equal(got.cpu(), ref),
                  "delivered at the boundary" if i < len(numels) - 1 else "delivered by flush")
    res.numbers.update(max_abs_error_vs_float64=errors, **reducer.stats())
    # a delivered slot is clean (the next window overwrites it, see NodeGradBuffer.accumulate): nothing stays dirty
    res.check("buffer empty after the window", flat is not None and not reducer.buffer.dirty,
              f"dirty: {sorted(reducer.buffer.dirty)}")
    res.check("one parameter flushed", reducer.counters.flushed == 1, f"flushed {reducer.counters.flushed}")
    return res


def _warm_up_communicators(res: CaseResult, dist, backend: str) -> None:
    """[Note: why warm up] FCDP's warm-up on two fresh groups (the node and node-peer groups of a real layout;
    NCCL creates a communicator per group at its first collective): accelerator memory each one took."""
    from fcdp_deepspeed.machine import comm_warmup
    measured = comm_warmup.warm_up({"node": dist.new_group([0]), "node_peers": dist.new_group([0])})
    res.numbers.update(comm_warmup_bytes=measured, comm_warmup_seconds=sum(comm_warmup.SECONDS))
    res.check("communicator warm-up ran on both groups", set(measured) == {"node", "node_peers"}, f"{measured}")
    res.check("communicator warm-up memory measured (NCCL, outside the caching allocator)",
              all(v >= 0 for v in measured.values()), f"{measured} bytes", applicable=backend == "nccl")


def multi_gpu_rank(hidden: int, layers: int, steps: int, per_node: int, backend: str = "nccl") -> dict:
    """One rank of the multi-GPU case: losses and step times per variant (``backend="gloo"`` on the
    CPU accelerator runs the same code, for development)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import fcdp_deepspeed
    from fcdp_lab.harness import toy

    get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend=backend)
    # the one GPU's "nodes" share its links: declare the slow link the check stands for (fcdp.link)
    node = lambda **kw: {"enabled": True, "ranks_per_node": per_node, "link": "slow", **kw}  # noqa: E731
    # [Note: hpZ last] after an hpZ engine, FCDP refuses later models as partitioned with an hpZ
    # group (found by running this case on gloo); nothing FCDP runs after it here.
    flat = {"grad_reduce": "flat", "grad_accumulation": "rank"}  # ZeRO-3's summation order: bit-identical
    variants = {"zero3": (None, {}), "host": (node(cache_device="host", **flat), {}),
                "device": (node(cache_device="device", **flat), {}),
                # the run-ahead on streams (runtime/staged.py, opt-in): stage 1 ahead through pinned stashes
                "host_ahead": (node(cache_device="host", param_runahead_streams=True, **flat), {}),
                "zero3_ga2": (None, {"grad_accum": 2}),
                "hierarchical_ga2": (node(cache_device="host", grad_reduce="hierarchical", grad_accumulation="rank"),
                                     {"grad_accum": 2}),
                "node_ga2": (node(cache_device="host", grad_accumulation="node"), {"grad_accum": 2}),
                "zero3_bf16": (None, {"dtype": "bf16"}),
                "host_bf16": (node(cache_device="host", **flat), {"dtype": "bf16"}),
                "hpz": (None, {"hpz": per_node})}
    out = {}
    for name, (block, kw) in variants.items():
        cfg = toy.ds_config(block, regime="large", micro_batch=8, **kw)
        engine = toy.build_engine(cfg, hidden=hidden, layers=layers)
        dtype = torch.bfloat16 if kw.get("dtype") == "bf16" else torch.float32
        run = toy.train(engine, max(steps, 5), hidden=hidden, dtype=dtype)  # >= 4 timed steps after the first
        get_accelerator().synchronize()
        out[name] = {"losses": run.losses, "step_times": run.step_times}
        if name == "host_ahead":
            stats = fcdp_deepspeed.get_stats(engine)
            out[name]["stats"] = {k: stats.get(k) for k in ("param_push_groups", "param_push_used",
                                                            "param_push_cancelled", "param_push_unused")}
        if name == "host":  # one more step, traced: the two-stage gather's stages on real NCCL
            out[name]["gather_timeline"] = _traced_step(engine, hidden, per_node)
            stats = fcdp_deepspeed.get_stats(engine)
            out[name]["stats"] = {k: stats.get(k) for k in ("memory", "pinned_pool_bytes", "hierarchical_gathers")}
        del engine
    return out


def _traced_step(engine, hidden: int, per_node: int) -> dict:
    """One step under the profiler with ranges around the two-stage gather's stages (``gpu_trace.stage_ranges``)."""
    from fcdp_deepspeed.machine.topology import group_ranks
    from fcdp_lab.gpu import trace as gpu_trace
    from fcdp_lab.harness import toy

    def spans(group) -> bool:
        ranks = group_ranks(group)
        return len({r // per_node for r in ranks}) == len(ranks) > 1

    with gpu_trace.traced(True) as holder, gpu_trace.stage_ranges(spans):
        toy.train(engine, 1, hidden=hidden)
    return holder[1]


def multi_gpu_case(results: list[dict], per_node: int) -> CaseResult:
    """Compare the ranks' runs: flat FCDP bit-identical, gradient modes within 1e-5, bf16 and times measured."""
    res = CaseResult("c_multi_gpu")
    res.numbers.update(world=len(results), per_node=per_node)

    def rel(a: list, b: list) -> float:
        return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)

    for r, run in enumerate(results):
        for name in ("host", "device", "host_ahead"):
            res.check(f"rank {r} {name}: losses bit-identical to ZeRO-3", run[name]["losses"] == run["zero3"]["losses"])
        ahead = run["host_ahead"]["stats"]
        res.check(f"rank {r} host_ahead: stage 1s issued ahead were used", (ahead["param_push_used"] or 0) > 0,
                  str(ahead))
        for name in ("hierarchical_ga2", "node_ga2"):
            err = rel(run[name]["losses"], run["zero3_ga2"]["losses"])
            res.check(f"rank {r} {name}: losses within 1e-5 of ZeRO-3 (fp32)", err <= 1e-5, f"max rel {err:.2e}")
        res.numbers[f"rank{r}_bf16_max_rel_loss_diff"] = rel(run["host_bf16"]["losses"], run["zero3_bf16"]["losses"])
    for r, run in enumerate(results):  # the two-stage gather on NCCL: see docs/gpu.md
        timeline = run["host"].get("gather_timeline") or {}
        waits = timeline.get("host_stage1_wait_us") or []
        res.numbers[f"rank{r}_gather_timeline"] = timeline
        res.numbers[f"rank{r}_host_stats"] = run["host"].get("stats")
        res.check(f"rank {r}: the host does not wait for stage 1 (median wait < {STAGE1_WAIT_US} us)",
                  statistics.median(waits) < STAGE1_WAIT_US if waits else None, f"{len(waits)} waits",
                  applicable=bool(waits))
        res.check(f"rank {r}: stage-2 kernels start after the stage-1 kernels before them end",
                  timeline.get("ordered"), f"{len(timeline.get('nccl_kernels') or [])} NCCL all-gather kernels",
                  applicable=timeline.get("ordered") is not None)
    median = {n: statistics.median(results[0][n]["step_times"][1:] or results[0][n]["step_times"])
              for n in ("zero3", "host", "device", "host_ahead", "hpz")}
    res.numbers["rank0_median_step_seconds"] = median
    res.numbers["rank0_step_time_vs_zero3"] = {n: t / median["zero3"] for n, t in median.items()}
    return res
