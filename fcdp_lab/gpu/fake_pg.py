"""Case (b) of the GPU check: this process is rank 0 of a fake process group of world size 4 (2 nodes
x 2) through ``deepspeed.initialize``. Collectives move no data, so values are meaningless; device
memory, copies, synchronizations and copy/compute overlap are real.
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import asdict
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

from fcdp_lab.gpu.report import CaseResult, call_site

#: A 5% margin on peak memory, as the issue states it.
MEMORY_TOLERANCE = 0.05


def gated_model(hidden: int, layers: int):
    """The toy MLP whose last block can be skipped (conditional computation, see :func:`train_step`)."""
    from fcdp_lab.harness import toy

    class GatedToy(toy.ToyModel):
        def forward(self, x: torch.Tensor, use_last: bool = True) -> torch.Tensor:
            h = self.inp(x)
            for i, block in enumerate(self.blocks):
                if use_last or i < len(self.blocks) - 1:
                    h = block(h)
            return self.out(h)

    torch.manual_seed(0)
    return GatedToy(hidden, layers)


@contextlib.contextmanager
def fake_node_discovery(ranks_per_node: int) -> Iterator[None]:
    """[Note: a fake group moves no data] FCDP's one object all-gather (node discovery) would return
    garbage; answer it with what the 4 ranks of the layout would send. Everything else is FCDP's."""
    from deepspeed import comm as dist

    from fcdp_deepspeed.machine import topology
    original = topology.discover_node_map

    def discover(ranks_per_node_arg=None, dp_group=None):
        world = dist.get_world_size()
        return (tuple(f"node{r // ranks_per_node}" for r in range(world)), "fcdp.ranks_per_node",
                [tuple(range(world))] * world)

    topology.discover_node_map = discover
    try:
        yield
    finally:
        topology.discover_node_map = original


def train_step(engine, micro: int, hidden: int) -> tuple[list[torch.Tensor], int]:
    """One optimizer step of the gated model, inputs on the engine's device; losses stay on the device.
    [Note: gate pattern] The last block is skipped on every 4th micro-step only: each skip changes the
    module order, so DeepSpeed drops its prefetch trace and re-records it; the micro-steps in between
    run with a complete trace, i.e. with prefetching."""
    from fcdp_lab.harness import toy
    losses = []
    for _ in range(engine.gradient_accumulation_steps()):
        x, y = toy.batch(micro, engine.train_micro_batch_size_per_gpu(), hidden)
        loss = F.mse_loss(engine(x.to(engine.device), use_last=micro % 4 != 3), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        micro += 1
    return losses, micro


def measure_variant(fcdp: Optional[dict], hidden: int, layers: int, steps: int, on_gpu: bool,
                    **zero_extra: Any) -> dict:
    """Build, train ``steps`` traced steps and release one engine; memory relative to before it.
    ``zero_extra``: more ``zero_optimization`` keys (the like-for-like ZeRO-3 sets ``reduce_bucket_size``)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import fcdp_deepspeed
    from fcdp_lab.gpu import trace as gpu_trace
    from fcdp_lab.harness import toy

    acc = get_accelerator()
    gc.collect()
    acc.empty_cache()
    base, base_reserved = acc.memory_allocated(), acc.memory_reserved()
    acc.reset_peak_memory_stats()
    block = {"enabled": True, "ranks_per_node": 2, "link": "slow", **fcdp} if fcdp is not None else None
    # prefetch on, parameters released after use (the regime where backward re-gathers)
    cfg = toy.ds_config(block, regime="default", grad_accum=2, stage3_max_reuse_distance=0,
                        stage3_prefetch_bucket_size=2 * hidden * hidden, **zero_extra)
    fcdp_deepspeed.install()
    model = gated_model(hidden, layers)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    out: dict[str, Any] = {"peak_allocated": [], "peak_reserved": [], "seconds": [], "trace": [], "skipped": [],
                           "fills": [], "hits": [], "workspace_allocations": []}
    micro, losses = 0, []
    for _ in range(steps):
        acc.reset_peak_memory_stats()
        before = step_counts(engine)
        t0 = time.perf_counter()
        with gpu_trace.traced(on_gpu) as holder, gpu_trace.stage_ranges(spans_nodes):
            step_losses, micro = train_step(engine, micro, hidden)
        losses += step_losses
        acc.synchronize()
        for key, value in step_counts(engine).items():  # per step: skipped steps, fills (+ refreshes), hits
            out[key].append(value - before[key])
        out["seconds"].append(time.perf_counter() - t0)
        out["peak_allocated"].append(acc.max_memory_allocated() - base)
        out["peak_reserved"].append(acc.max_memory_reserved() - base_reserved)
        out["trace"].append({**asdict(holder[0]), "overlap_fraction": holder[0].overlap_fraction,
                             "gather_timeline": holder[1]})
    out["losses"] = [float(v) for v in losses]
    out["reserved_by_stream"] = reserved_by_stream(on_gpu, getattr(engine.optimizer, "reduce_and_partition_stream", None))
    out["reduce_bucket_size"] = int(getattr(engine.optimizer, "reduce_bucket_size", 0) or 0)
    stats = fcdp_deepspeed.get_stats(engine)
    out["stats"] = {k: stats.get(k) for k in ("cache_hits", "host_pool_bytes", "device_pool_bytes", "pinned_pool_bytes",
                                              "h2d_async_copies", "h2d_async_bytes", "grad_buffer_host_bytes",
                                              "grad_buffer_device_bytes", "grad_flushed", "memory",
                                              "hierarchical_gathers", "param_push_groups", "param_push_used",
                                              "param_push_cancelled", "param_push_unused", "grad_workspace_bytes",
                                              "grad_workspace_allocations", "grad_workspace_peak_leases")}
    del engine, model
    return out


def reserved_by_stream(on_gpu: bool, reduce_stream: Any = None) -> dict[str, int]:
    """The caching allocator's segments (reserved bytes) by the stream they belong to, named where the stream is
    the current one or one of FCDP's side streams (``device.side_stream``); a block freed on one stream is reused
    only by allocations on that stream, so memory spread over streams is reserved memory that the others cannot
    take (the open reserved overshoot of the H200 runs, gpu.md). Read after the steps: nothing was handed
    back since, so it is the reserved peak's layout. Empty on the CPU accelerator."""
    if not on_gpu:
        return {}
    from fcdp_deepspeed.machine import device
    names = {torch.cuda.current_stream().cuda_stream: "current"}
    if reduce_stream is not None and hasattr(reduce_stream, "cuda_stream"):
        names[reduce_stream.cuda_stream] = "deepspeed:reduce"
    names.update({stream.cuda_stream: f"fcdp:{name}" for name, stream in device.side_streams()})
    out: dict[str, int] = {}
    for seg in torch.cuda.memory_snapshot():
        key = names.get(seg.get("stream"), f"stream {seg.get('stream')}")
        out[key] = out.get(key, 0) + int(seg.get("total_size", 0))
    return out


def step_counts(engine) -> dict:
    """Running totals: DeepSpeed's skipped optimizer steps, FCDP's slot fills (refreshes included) and hits, the
    gradient stages' workspace buffers allocated."""
    import fcdp_deepspeed
    stats = fcdp_deepspeed.get_stats(engine) or {}
    return {"skipped": int(getattr(engine, "skipped_steps", 0) or 0),
            "fills": int(stats.get("cache_fills") or 0) + int(stats.get("cache_refreshes") or 0),
            "hits": int(stats.get("cache_hits") or 0),
            "workspace_allocations": int(stats.get("grad_workspace_allocations") or 0)}


def steady_state_problem(run: dict) -> str:
    """Why ``run``'s steady state (steps 2 and later) says nothing about refills ("" when it does): a skipped
    step writes no weights, so nothing is invalidated and the next step is all hits with no fill, which would
    make the counts and overlap of a refilling step look free. Full fine-tuning refills every step it applied."""
    skipped, fills = run["skipped"][1:], run["fills"][1:]
    if not skipped:
        return "no steady-state step measured"
    if any(skipped):
        return f"steady-state steps skipped (per step {skipped}): all hits, nothing refilled"
    if not all(fills):
        return f"a steady-state step refilled nothing (fills per step {fills})"
    return ""


def within(value: float, reference: float, tolerance: float = MEMORY_TOLERANCE) -> bool:
    return abs(value - reference) <= tolerance * max(reference, 1)


def at_most(value: float, reference: float, tolerance: float = MEMORY_TOLERANCE) -> bool:
    """The user's claim: FCDP never needs more accelerator memory than ZeRO-3 (+ the margin); less is fine."""
    return value <= reference + tolerance * max(reference, 1)


def init_fake_world(res: CaseResult) -> None:
    """This process becomes rank 0 of a fake world of 4 (2 nodes x 2), adopted by ``deepspeed.init_distributed``."""
    import torch.distributed as tdist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
    get_accelerator().set_device(0)
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    deepspeed.init_distributed()
    zero_reduction_outputs()
    res.check("deepspeed.init_distributed adopts the fake group",
              dist.get_world_size() == 4 and tdist.get_backend() == "fake",
              f"world {dist.get_world_size()}, backend {tdist.get_backend()}")


#: The reductions whose output a fake group leaves as allocated: (method, name of the output argument).
_REDUCTIONS = (("reduce_scatter_tensor", "output_tensor"), ("reduce_scatter", "output"), ("all_to_all_single", "output"))


def zero_reduction_outputs() -> None:
    """[Note: finite gradients in a fake world] A fake group moves no data: a reduce-scatter's output keeps whatever
    the allocator handed out, and inf or NaN there made DeepSpeed skip optimizer steps (seen in the dry run:
    steps skipped, so the next step was all hits with nothing refilled, and case b measured no refilling step).
    The gradient path's reductions get a zeroed output (one memset on the issuing stream each, no host wait);
    in-place all-reduces keep this rank's own value, which is what FCDP's agreements need (every rank of the
    fake world would send the same). Gathers are left alone (parameter values are meaningless anyway)."""
    from deepspeed.comm import comm as ds_comm
    backend = ds_comm.cdb
    for method, out_name in _REDUCTIONS:
        original = getattr(backend, method, None)
        if original is None or getattr(original, "_fcdp_zeroed", False):
            continue

        def zeroed(*args, _original=original, _name=out_name, **kwargs):
            work = _original(*args, **kwargs)
            out = args[0] if args else kwargs.get(_name)
            if isinstance(out, torch.Tensor):
                out.zero_()
            return work

        zeroed._fcdp_zeroed = True  # type: ignore[attr-defined]
        setattr(backend, method, zeroed)


def spans_nodes(group) -> bool:
    """Whether a group of the fake 2 x 2 layout spans nodes (stage 1 of the two-stage gather)."""
    from fcdp_deepspeed.machine.topology import group_ranks
    ranks = group_ranks(group)
    return len({r // 2 for r in ranks}) == len(ranks) > 1


def fake_pg_case(dry_run: bool, hidden: int, layers: int, steps: int) -> CaseResult:
    """(b) This process is rank 0 of a fake world of 4 (2 nodes x 2)."""
    from fcdp_deepspeed.engine.grad_steps import AUTO_SHARE_OF_DEEPSPEED, MIN_AUTO_BUCKET
    res = CaseResult("b_fake_pg")
    init_fake_world(res)
    on_gpu = not dry_run
    # [Note: two ZeRO-3 references] FCDP caps DeepSpeed's reduce bucket (``fcdp.grad_bucket_size: auto``, a few
    # buckets of the trainable elements) and shrinks its contiguous bucket buffer, which DeepSpeed allocates at
    # ``reduce_bucket_size`` (5e8 elements: 2 GB in fp32) whatever the model's size. Seen on the first H200 run: FCDP
    # peaked 2.0 GB *below* ZeRO-3, so a two-sided 5% check against ZeRO-3's defaults failed on a saving, while with
    # the *same* bucket (``zero3_same_bucket``) FCDP was 1.16 buckets above ZeRO-3 (the gradient stages in flight).
    # So: the user's claim, one-sided against ZeRO-3's defaults; FCDP's own extra against ``zero3_same_bucket``, at
    # most 2 buckets (what ``auto``'s third of DeepSpeed's bucket assumes: [Note: the bucket pays for the stages in
    # flight] in ``engine/grad_steps.py``); and the large-model regime, where ``auto`` no longer shrinks an oversized
    # buffer: both with ``reduce_bucket_size`` at an eighth of the model (``large_*``), FCDP at most ZeRO-3 (+5%).
    # ``host_sync``: the stages not in flight (``grad_inflight_buckets: 0``), a number to attribute the extra.
    variants = {"zero3": None, "host": {"cache_device": "host"},
                "device": {"cache_device": "device", "device_budget": "50%"}, "auto": {"cache_device": "auto"},
                "node_host": {"cache_device": "host", "grad_accumulation": "node", "grad_buffer_device": "host"},
                # issue 31: the run-ahead on streams (runtime/staged.py), opt-in until this case has run on a GPU
                "host_ahead": {"cache_device": "host", "param_runahead_streams": True}}
    fcdp_variants = [n for n in variants if n != "zero3"]
    runs: dict[str, dict] = {}
    with fake_node_discovery(ranks_per_node=2):
        for name, extra in variants.items():
            try:
                runs[name] = measure_variant(extra, hidden, layers, steps, on_gpu)
            except Exception as exc:  # report it, keep the other variants' numbers
                res.check(f"{name}: ran", False, call_site(exc))
        bucket = runs.get("host", {}).get("reduce_bucket_size")
        more = {"zero3_same_bucket": (None, bucket), "host_sync": ({"cache_device": "host", "grad_inflight_buckets": 0},
                                                                   None),
                "large_host": ({"cache_device": "host"}, bucket)}
        for name, (extra, ds_bucket) in more.items() if bucket else ():
            try:
                runs[name] = measure_variant(extra, hidden, layers, steps, on_gpu,
                                             **({"reduce_bucket_size": ds_bucket} if ds_bucket else {}))
            except Exception as exc:
                res.check(f"{name}: ran", False, call_site(exc))
    res.numbers.update(hidden=hidden, layers=layers, steps=steps, runs=runs)
    if len(runs) < len(variants) + len(more):
        return res
    z, zs, host, auto = runs["zero3"], runs["zero3_same_bucket"], runs["host"], runs["auto"]
    why = "" if on_gpu else "CPU accelerator: no device memory or streams"
    bucket_bytes = bucket * 4  # the toy is fp32
    res.numbers["reduce_bucket_size"] = {n: r["reduce_bucket_size"] for n, r in runs.items()}
    res.numbers["extra_over_same_bucket_in_buckets"] = {
        n: round((max(runs[n]["peak_allocated"]) - max(zs["peak_allocated"])) / bucket_bytes, 3)
        for n in ("host", "node_host", "host_sync")}
    for name in ("host", "node_host", "host_ahead"):
        for kind in ("allocated", "reserved"):
            a, b, c = max(runs[name][f"peak_{kind}"]), max(z[f"peak_{kind}"]), max(zs[f"peak_{kind}"])
            res.check(f"{name}: peak {kind} at most ZeRO-3's (+5%)", at_most(a, b), f"{a} vs {b} bytes {why}", on_gpu)
            res.check(f"{name}: peak {kind} at most ZeRO-3's with the same bucket + 2 buckets", a <= c + 2 * bucket_bytes,
                      f"{a} vs {c} bytes, bucket {bucket_bytes} bytes {why}", on_gpu)
    # issue 51 part 1: [Note: a fixed workspace per stage] (grads/workspace.py): the reduce stream's reserved memory at
    # most ZeRO-3's (same bucket) + one bucket; the whole allocator's too, but for FCDP's own streams (the cache's
    # copies: ZeRO-3 has no such stream), reported
    for name in ("host", "node_host"):
        mine, theirs = runs[name]["reserved_by_stream"], zs["reserved_by_stream"]
        a, c = mine.get("deepspeed:reduce", 0), theirs.get("deepspeed:reduce", 0)
        res.check(f"{name}: reduce stream reserved at most ZeRO-3's with the same bucket + 1 bucket",
                  a <= c + bucket_bytes, f"{a} vs {c} bytes, bucket {bucket_bytes} bytes {why}", on_gpu)
        side = sum(v for k, v in mine.items() if k.startswith("fcdp:"))
        a, c = max(runs[name]["peak_reserved"]), max(zs["peak_reserved"])
        res.check(f"{name}: peak reserved but FCDP's side streams at most ZeRO-3's with the same bucket + 1 bucket",
                  a - side <= c + bucket_bytes, f"{a} - {side} (side streams) vs {c} bytes, bucket {bucket_bytes} "
                  f"bytes {why}", on_gpu)
        ws = runs[name]["stats"]
        later = runs[name]["workspace_allocations"][1:]
        res.check(f"{name}: the gradient stages' workspace allocated nothing after step 1",
                  ws.get("grad_workspace_allocations") and not any(later),
                  f"{ws.get('grad_workspace_bytes')} bytes in {ws.get('grad_workspace_allocations')} buffers, "
                  f"peak leases {ws.get('grad_workspace_peak_leases')}")
    large, large_z = max(runs["large_host"]["peak_allocated"]), max(zs["peak_allocated"])
    res.check("large-model regime: auto takes a third of DeepSpeed's bucket",
              runs["large_host"]["reduce_bucket_size"] <= max(bucket // AUTO_SHARE_OF_DEEPSPEED, MIN_AUTO_BUCKET),
              f"{runs['large_host']['reduce_bucket_size']} of {bucket}")
    res.check("large-model regime: peak allocated at most ZeRO-3's with the same config (+5%)", at_most(large, large_z),
              f"{large} vs {large_z} bytes {why}", on_gpu)
    node = runs["node_host"]["stats"]
    res.check("node_host: gradient buffer on the host", (node["grad_buffer_host_bytes"] or 0) > 0
              and not node["grad_buffer_device_bytes"], f"{node['grad_buffer_host_bytes']} host bytes")
    res.check("node_host: the gated block's window sums were flushed", (node["grad_flushed"] or 0) > 0,
              f"{node['grad_flushed']} flushed")
    ahead = runs["host_ahead"]["stats"]
    res.check("host_ahead: stage 1s issued ahead were used", (ahead["param_push_used"] or 0) > 0,
              f"{ahead['param_push_groups']} issued, {ahead['param_push_used']} used, "
              f"{ahead['param_push_cancelled']} cancelled, {ahead['param_push_unused']} unused")
    for name in fcdp_variants:
        res.check(f"{name}: cache served hits", (runs[name]["stats"]["cache_hits"] or 0) > 0,
                  f"{runs[name]['stats']['cache_hits']} hits")
        problem = steady_state_problem(runs[name])
        res.check(f"{name}: steady-state steps applied and refilled (not all hits from skipped steps)", not problem,
                  problem or f"fills per step {runs[name]['fills']}, hits per step {runs[name]['hits']}, "
                             f"skipped per step {runs[name]['skipped']}")
    res.check("host: pool pinned", (host["stats"]["pinned_pool_bytes"] or 0) > 0, why, on_gpu)
    a1, z1, zs1 = auto["peak_allocated"][0], z["peak_allocated"][0], zs["peak_allocated"][0]
    res.check("auto: step-1 peak at most ZeRO-3's (+5%)", at_most(a1, z1), f"{a1} vs {z1} bytes {why}", on_gpu)
    res.check("auto: step-1 peak at most ZeRO-3's with the same bucket + 2 buckets", a1 <= zs1 + 2 * bucket_bytes,
              f"{a1} vs {zs1} bytes {why}", on_gpu)
    # ZeRO-3 grows too after step 1 (its optimizer states: 71 MB on the H200 run): only the excess is the pool's.
    grown, pool = auto["peak_allocated"][-1] - a1, auto["stats"]["device_pool_bytes"] or 0
    zs_grown = zs["peak_allocated"][-1] - zs1
    res.check(f"auto: step-{steps} growth over step 1 at most ZeRO-3's growth + its device pool (+5%)",
              grown <= zs_grown + pool + MEMORY_TOLERANCE * zs1,
              f"grew {grown}, ZeRO-3 grew {zs_grown}, pool {pool} bytes {why}", on_gpu)
    for name in fcdp_variants:  # steady state: steps after the first (which builds the trace)
        for key in ("syncs", "sync_memcpys", "pageable_copies"):
            extra = [r[key] - q[key] for r, q in zip(runs[name]["trace"][1:], z["trace"][1:])]
            res.check(f"{name}: {key} per step <= ZeRO-3's", max(extra, default=0) <= 0,
                      f"per-step excess {extra} {why}", on_gpu)
    res.numbers.update(auto_peak_allocated_step1=a1, auto_peak_allocated_last_step=auto["peak_allocated"][-1])
    res.numbers["h2d_overlap_fraction"] = {n: [t["overlap_fraction"] for t in r["trace"]] for n, r in runs.items()}
    return res
