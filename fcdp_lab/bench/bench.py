"""Side-by-side benchmark on an emulated commodity cluster: ZeRO-3, ZeRO++ hpZ, FCDP with DeepSpeed's
gradient path (``fcdp``) and FCDP with node-local gradient accumulation (``fcdp_node``), plus the
computed lower bound (``bound`` rows: changed parameters into each node once, its gradient out once).

    python -m fcdp_lab bench [--rates 100,200,1000,10000,0] [--jobs full,lora] [--grad-accum 1,4] [--layout 2x2,2x4] [--out results/bench]
    python -m fcdp_lab bench --preset compression --out results/bench_compression   # issue 23's targets, one command
    python -m fcdp_lab.bench ...      # same

Lossy inter-node compression (issue 23): ``fcdp_int8``/``fcdp_int4`` (and the one-sided ``fcdp_pint*``,
``fcdp_gint*``) are ``fcdp_node`` plus ``param_compression``/``grad_compression``; rows carry ratios against
the exact bound and against ``fcdp_node`` (``*_vs_exact``), and a step-time floor (``step_vs_floor``); see
``tools/bench/compression.py``.

Every bandwidth is a fresh :class:`~fcdp_lab.harness.cluster.EmulatedCluster` (2 nodes x 2 ranks
by default, uplinks shaped with ``tc tbf``; rate 0 = unlimited, the no-network bound). For each job
(full fine-tune, LoRA) and accumulation setting the engines train the same model on the same data, each in fresh
processes (an engine measured after another one in the same process ran 2-3% slower, whichever it
was, and peak memory would mix engines), ``--repeats`` times in interleaved order; the step time
is the median over every timed step of every repeat (single runs vary by up to +-8% on 2 cores). Per run: median step time, samples/s, inter-node bytes per step from
the kernel's interface counters and from our own collective counters (they must agree within 5%),
cache and peak memory, losses (identical across engines). Results: JSON, CSV, a PNG plot and
``runs.jsonl`` (each run's raw record, written as it arrives).

Release regime: ``large`` (default) sets ``stage3_max_reuse_distance=0`` and
``stage3_prefetch_bucket_size=0`` so ZeRO-3 releases every parameter after use, which is what a
model larger than accelerator memory does; a model this small would otherwise stay gathered
between forward and backward and no engine would re-gather anything (``--regime default``).
"""
from __future__ import annotations

import csv
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from fcdp_lab.bench.compression import (COMPRESSED_ENGINES, EXACT_ENGINE, PRESETS, _layout, add_step_floor,
                                                    compressed_blocks, compression_stats, parse_layouts, targets,
                                                    targets_markdown)

ENGINES = ("zero3", "hpz", "fcdp", "fcdp_node")
JOBS = ("full", "lora")
#: The fcdp block of each FCDP engine (``ranks_per_node`` and host placement are added per run).
FCDP_BLOCKS = {"fcdp": {"grad_reduce": "flat", "grad_accumulation": "rank"}, "fcdp_node": {"grad_accumulation": "node"},
               "fcdp_node_flat": {"grad_accumulation": "node", "param_gather": "flat"},
               # the block's defaults as a user writes it: every path key auto, fcdp.link's probe chooses the paths
               "fcdp_defaults": {},
               # ZeRO-3's paths declared (no probe, no node or node-peer communicator): fcdp_defaults' fast-link choice
               "fcdp_fast": {"link": "fast"},
               # fcdp.layered: the defaults, the GA window run as one batch in --grad-accum chunks (layered/stack.py)
               "fcdp_layered": {},
               # issue 31: the run-ahead of stage 1 (runtime/runahead.py) is opt-in; the committed
               # docs/bench_overlap_* run predates that and names the push-on engine fcdp_node
               "fcdp_node_nopush": {"grad_accumulation": "node", "param_push_bytes": 0},
               # the defaults without the run-ahead from the window's first fetch (param_runahead_bytes, default on)
               "fcdp_node_noahead": {"grad_accumulation": "node", "param_runahead_bytes": 0},
               "fcdp_node_push": {"grad_accumulation": "node", "param_push_bytes": 2**30},
               # a rolling push of a few groups ([Note: a rolling push]): 8 MiB of host buffers in flight
               "fcdp_node_push8m": {"grad_accumulation": "node", "param_push_bytes": 8 * 2**20},
               # issue 31 item 3: the gradient's inter-node stage as before it ran behind the backward (each stage
               # waited for where it is issued, DeepSpeed's bucket size: one bucket for the bench model)
               "fcdp_node_syncgrad": {"grad_accumulation": "node", "grad_inflight_buckets": 0, "grad_bucket_size": 0},
               # the hierarchical reduce with DeepSpeed's per-rank accumulation (no node buffer)
               "fcdp_hier_rank": {"grad_reduce": "hierarchical", "grad_accumulation": "rank"},
               # the cache alone: DeepSpeed's flat gather for misses and its gradient path
               "fcdp_flat": {"param_gather": "flat", "grad_reduce": "flat", "grad_accumulation": "rank"},
               # FCDP's wrappers with nothing cached and every path DeepSpeed's: the fixed cost of being installed
               "fcdp_nocache": {"param_gather": "flat", "grad_reduce": "flat", "grad_accumulation": "rank",
                                "min_numel": 2**62}}
FCDP_BLOCKS |= compressed_blocks(FCDP_BLOCKS[EXACT_ENGINE])
#: Lossy DiLoCo across nodes (issue 32, docs/diloco.md): time whole sync intervals (``--steps`` a multiple of H).
DILOCO_ENGINES = {"diloco10": {"sync_every": 10}, "diloco10_int4": {"sync_every": 10, "compression": "int4"},
                  "diloco100_int4": {"sync_every": 100, "compression": "int4"},
                  # streaming: one fifth of the model every 2 steps, each exchange overlapped with the next step
                  "diloco10_int4_f5": {"sync_every": 10, "compression": "int4", "fragments": 5}}
FCDP_BLOCKS |= {name: {"diloco": block} for name, block in DILOCO_ENGINES.items()}
#: Every engine ``--engines`` accepts: the defaults plus ``fcdp_node_flat`` (``fcdp_node`` with DeepSpeed's
#: flat ring for misses, to compare the two-stage gather side by side in one run) and the lossy
#: ``fcdp_int8``/``fcdp_int4``/... (``tools/bench/compression.py``).
ALL_ENGINES = (*ENGINES, "fcdp_defaults", "fcdp_fast", "fcdp_layered", "fcdp_node_flat", "fcdp_node_nopush", "fcdp_node_noahead", "fcdp_node_push", "fcdp_node_push8m", "fcdp_node_syncgrad", "fcdp_flat", "fcdp_nocache",
               "fcdp_hier_rank", *COMPRESSED_ENGINES,
               *DILOCO_ENGINES)
#: ``ENGINE@before``: that engine run from another checkout (``--before-src``, e.g. ``git archive`` of the commit
#: before a change), interleaved with this one's engines in one run: a side-by-side before/after on one machine.
BEFORE = "@before"


@dataclass
class BenchSpec:
    nodes: int = 2
    ranks_per_node: int = 2
    layouts: Sequence[str] = ()
    """``NODESxRANKS`` layouts to sweep (``--layout 2x2,2x4,4x2``); empty: ``nodes`` x ``ranks_per_node``."""
    rates_mbit: Sequence[float] = (100, 200, 1000, 10000, 0)
    jobs: Sequence[str] = JOBS
    engines: Sequence[str] = ENGINES
    hidden: int = 512
    layers: int = 8
    lora_rank: int = 2
    micro_batch: int = 8
    grad_accums: Sequence[int] = (1, )
    """Gradient accumulation steps to sweep; each run uses one (``grad_accum``)."""
    grad_accum: int = 1
    warmup: int = 2
    steps: int = 5
    repeats: int = 3
    regime: str = "large"
    param_gather: str = "auto"
    """``fcdp.param_gather`` of the FCDP engines (how cache misses are gathered; rows record the resolved mode)."""
    compression_block: int = 128
    """``fcdp.compression_block`` of the compressed engines."""
    fcdp_extra: dict = field(default_factory=dict)
    """More ``fcdp`` keys for every FCDP engine (``--fcdp-extra '{"param_refresh_interval": 0}'``), after the engine's own."""
    timeout_s: float = 900
    before_src: str = ""
    """The source tree (its ``fcdp_deepspeed`` package) that ``ENGINE@before`` engines run from."""
    sample_links: bool = False
    """Sample the uplinks' counters every millisecond at shaped rates ([Note: link samples] in ``harness/links.py``):
    each shaped row gets ``links_last_step``, what the links did in the traced step."""

    #: Fields only the driver reads: never sent to another checkout's ``rank_main`` (``ENGINE@before``).
    DRIVER_ONLY = ("before_src", "sample_links")

    def layout_list(self) -> list[tuple[int, int]]:
        return [tuple(int(x) for x in lay.split("x")) for lay in self.layouts] or [(self.nodes, self.ranks_per_node)]


_COUNTERS = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")


def _uplink_counters() -> dict:
    """This node's uplink counters, read from inside the node's namespace."""
    base = "/sys/class/net/eth0/statistics/"
    try:
        return {k: int(open(base + k).read()) for k in _COUNTERS}
    except OSError:
        return dict.fromkeys(_COUNTERS, 0)


def _uplink_use(c0: dict, c1: dict) -> dict:
    """Payload (headers excluded) and frame bytes this node's uplink carried each way between two readings."""
    from fcdp_lab.harness.cluster import HEADER_BYTES
    out = {}
    for way in ("tx", "rx"):
        frames = c1[f"{way}_bytes"] - c0[f"{way}_bytes"]
        out[f"{way}_frames"] = frames
        out[f"{way}_payload"] = frames - HEADER_BYTES * (c1[f"{way}_packets"] - c0[f"{way}_packets"])
    return out


def rank_main(spec: dict, job: str) -> list[dict]:
    """One job, the engines of ``spec``, on this rank. Returns per-engine records (complete on rank 0)."""
    import torch

    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import groups

    import fcdp_deepspeed
    from fcdp_deepspeed.config import ds_compat
    from fcdp_deepspeed.reporting import timeline
    from fcdp_deepspeed.reporting.stats import LEDGER
    from fcdp_lab.harness import toy
    from fcdp_lab.harness.cluster import HEADER_BYTES

    s = BenchSpec(**spec)
    deepspeed.init_distributed(dist_backend="gloo")
    fcdp_deepspeed.enable_comm_counting(s.ranks_per_node)
    local_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    lora_rank = s.lora_rank if job == "lora" else 0
    reference = toy.ToyModel(s.hidden, s.layers, lora_rank)  # unpartitioned, for the planner's model facts
    no_backward = toy.no_backward_numel(reference, torch.randn(2, s.hidden))
    del reference
    records = []
    for engine_name in s.engines:
        block = ({"enabled": True, "ranks_per_node": s.ranks_per_node, "cache_device": "host",
                  "param_gather": s.param_gather, **FCDP_BLOCKS[engine_name]} if engine_name in FCDP_BLOCKS else None)
        if engine_name in COMPRESSED_ENGINES:
            block["compression_block"] = s.compression_block
        if block is not None:
            block.update(s.fcdp_extra)
        ga, micro = s.grad_accum, s.micro_batch
        if engine_name == "fcdp_layered" and ga > 1:  # the same global batch: one batch of the window, in chunks
            block["layered"], ga, micro = ga, 1, micro * ga
        cfg = toy.ds_config(block, regime=s.regime, grad_accum=ga, micro_batch=micro,
                            hpz=s.ranks_per_node if engine_name == "hpz" else 0)
        get_accelerator().reset_peak_memory_stats()
        engine = toy.build_engine(cfg, hidden=s.hidden, layers=s.layers, lora_rank=lora_rank)
        warm = toy.train(engine, s.warmup, hidden=s.hidden)
        dist.barrier()
        c0, l0 = _uplink_counters(), LEDGER.totals.copy()
        stats0 = fcdp_deepspeed.get_stats(engine)
        clock, spans = getattr(engine.optimizer, "fcdp_clock", None), []
        if clock is not None:
            clock.events = []  # [Note: the trace] (timeline.py): the timed steps' spans, for the last step's picture
        res = toy.train(engine, s.steps, hidden=s.hidden, seed=1, spans=spans)
        dist.barrier()
        c1 = _uplink_counters()
        counted = LEDGER.totals.minus(l0)
        payload = ((c1["tx_bytes"] - c0["tx_bytes"]) - HEADER_BYTES * (c1["tx_packets"] - c0["tx_packets"])
                   if local_first else 0)
        stats1 = fcdp_deepspeed.get_stats(engine)
        use = _uplink_use(c0, c1) if local_first else None
        mine = {
            "payload": payload,
            "uplink": use,
            "wire": sum(counted.wire.values()),
            "step_times": res.step_times,
            "peak_mem": get_accelerator().max_memory_allocated(),
            "timeline": timeline.per_step(stats0, stats1, s.steps),
            "trace": _last_step_trace(spans, clock.events if clock is not None else []),
        }
        if clock is not None:
            clock.events = None
        everyone: list = [None] * dist.get_world_size()
        ds_compat.all_gather_object(everyone, mine)
        step_times = [max(r["step_times"][i] for r in everyone) for i in range(s.steps)]  # slowest rank
        links = [r["uplink"] for r in everyone if r["uplink"] is not None]  # one per node
        step_time = statistics.median(step_times)
        samples = s.micro_batch * s.grad_accum * dist.get_world_size()
        records.append({
            "job": job, "engine": engine_name, "regime": s.regime, "all_step_times": step_times,
            "samples_per_step": samples, "step_time_s": step_time, "samples_per_s": samples / step_time,
            # DiLoCo: the mean over whole sync intervals (--steps a multiple of H) is what a run takes per step;
            # the median hides the sync steps
            "step_time_mean_s": statistics.fmean(step_times),
            "kernel_inter_node_bytes_per_step": sum(r["payload"] for r in everyone) / s.steps,
            "counted_inter_node_bytes_per_step": sum(r["wire"] for r in everyone) / s.steps,
            "allgather_inter_node_bytes_per_step_rank0": (stats1["inter_node_allgather_bytes"] -
                                                          stats0["inter_node_allgather_bytes"]) / s.steps,
            "grad_reduce_inter_node_bytes_per_step_rank0": (stats1["inter_node_grad_reduce_bytes"] -
                                                            stats0["inter_node_grad_reduce_bytes"]) / s.steps,
            "grad_buffer_host_bytes_per_rank": stats1.get("grad_buffer_host_bytes", 0),
            "host_cache_bytes_per_rank": stats1.get("host_pool_bytes", 0),
            "device_cache_bytes_per_rank": stats1.get("device_pool_bytes", 0),
            "peak_memory_bytes": max(r["peak_mem"] for r in everyone),
            # host seconds per step and phase (timeline.py): rank 0's, and the largest over the ranks
            "timeline_s": everyone[0]["timeline"],
            "timeline_max_s": {k: max(r["timeline"][k] for r in everyone) for k in everyone[0]["timeline"]},
            "trace_last_step": _align_traces([r["trace"] for r in everyone]),
            "cache_hits": stats1["cache_hits"],
            "paths": stats1.get("paths"), "paths_why": stats1.get("paths_why"),
            "losses": warm.losses + res.losses,
            "params": sum(p.ds_numel for p in engine.module.parameters()),
            "trainable_params": sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad),
            "no_backward_params": no_backward,
            "world": dist.get_world_size(), "nodes": s.nodes, "grad_accum": s.grad_accum,
            "param_gather": stats1.get("param_gather", "flat"),  # plain engines: DeepSpeed's ring
            "layout": f"{s.nodes}x{s.ranks_per_node}",
            "param_compression": (block or {}).get("param_compression", "off"),
            "grad_compression": (block or {}).get("grad_compression", "off"),
            "compression_block": s.compression_block if engine_name in COMPRESSED_ENGINES else None,
            "compression_stats": compression_stats(stats0, stats1, s.steps),
            # the run-ahead's groups per timed step (runtime/runahead.py): issued ahead, used, cancelled, unused
            "runahead_stats": {f"{k}_per_step": (v - stats0.get(k, 0)) / s.steps for k, v in stats1.items()
                               if k.startswith("param_push") and k != "param_push_pending"},
            # the busiest node uplink, per step: the step-time floor of a shaped link (tools/bench/compression.py)
            "uplink_max_payload_bytes_per_step": max(max(u["tx_payload"], u["rx_payload"]) for u in links) / s.steps,
            "uplink_max_frame_bytes_per_step": max(max(u["tx_frames"], u["rx_frames"]) for u in links) / s.steps,
        })
        del engine
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None  # hpZ's group is process-global in DeepSpeed
        gc.collect()
    return records


def _last_step_trace(spans: list, events: list) -> dict:
    """The last timed optimizer step of one rank: its ``train_step``, forward/backward/step calls and timeline
    spans ([Note: the trace] in ``timeline.py``) that overlap it, in ``time.time()`` seconds."""
    steps = [sp for sp in spans if sp[0] == "train_step"]
    if not steps:
        return {"spans": [], "events": []}
    _, t0, t1 = steps[-1]
    keep = lambda items: [[n, a, b] for n, a, b in items if b >= t0 and a <= t1]  # noqa: E731
    return {"spans": keep(spans), "events": keep(events)}


def _align_traces(traces: list[dict]) -> list[dict]:
    """Every rank's last-step trace relative to the earliest start of that step on any rank (one wall clock:
    the ranks share a machine), rounded to 0.1 ms; ``origin_unix_s`` aligns it with outside samplers."""
    starts = [a for t in traces for n, a, _ in t["spans"] if n == "train_step"]
    origin = min(starts) if starts else 0.0
    shift = lambda items: [[n, round(a - origin, 4), round(b - origin, 4)] for n, a, b in items]  # noqa: E731
    return [{"rank": i, "origin_unix_s": origin, "spans": shift(t["spans"]), "events": shift(t["events"])}
            for i, t in enumerate(traces)]


def _combine(repeats: list[dict], rate: float, spec: BenchSpec) -> dict:
    """One row from the repeats of one (rate, job, engine): median step time over all timed steps."""
    row = dict(repeats[0])
    times = [t for r in repeats for t in r["all_step_times"]]
    row["rate_mbit"] = rate
    row["repeats"] = len(repeats)
    row["step_time_s"] = statistics.median(times)
    row["step_time_mean_s"] = statistics.fmean(times)
    row["samples_per_s"] = row["samples_per_step"] / row["step_time_s"]
    row["repeat_step_times_s"] = [r["step_time_s"] for r in repeats]
    for key in ("kernel_inter_node_bytes_per_step", "counted_inter_node_bytes_per_step",
                "allgather_inter_node_bytes_per_step_rank0", "grad_reduce_inter_node_bytes_per_step_rank0",
                "uplink_max_payload_bytes_per_step", "uplink_max_frame_bytes_per_step"):
        if key in row:
            row[key] = statistics.fmean(r[key] for r in repeats)
    row["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in repeats)
    for key in ("timeline_s", "timeline_max_s"):  # medians over the repeats, per phase
        if all(key in r for r in repeats):
            row[key] = {k: statistics.median(r[key][k] for r in repeats) for k in repeats[0][key]}
    row["losses_identical_across_repeats"] = all(r["losses"] == repeats[0]["losses"] for r in repeats)
    return row


def _job_key(r: dict) -> tuple:
    """What makes two rows the same job: job, GA and layout (nodes, world; older runs had one layout)."""
    return r["job"], r.get("grad_accum", 1), r.get("nodes", 2), r.get("world", 4)


def bound_rows(rows: list[dict]) -> list[dict]:
    """One computed ``bound`` row per (rate, job, GA): exact data parallelism's inter-node payload per
    optimizer step ((N-1) x trainable bytes in each direction over all uplinks, fp32 here) and the step
    time it allows on that uplink, never less than the fastest engine's no-network step time."""
    out = []
    for rate, job_key in sorted({(r["rate_mbit"], _job_key(r)) for r in rows}, key=str):
        same = [r for r in rows if _job_key(r) == job_key]
        base = same[0]
        nbytes = 2 * (base["nodes"] - 1) * base["trainable_params"] * 4
        no_net = [r["step_time_s"] for r in same if r["rate_mbit"] == 0]
        floor = min(no_net) if no_net else 0.0
        wire_s = nbytes / base["nodes"] / (rate * 1e6 / 8) if rate else 0.0
        step = max(floor, wire_s)
        out.append({**{k: base[k] for k in ("job", "regime", "samples_per_step", "params", "trainable_params",
                                              "no_backward_params", "world", "nodes", "grad_accum", "layout") if k in base},
                    "engine": "bound", "rate_mbit": rate, "step_time_s": step,
                    "samples_per_s": base["samples_per_step"] / step if step else None,
                    "kernel_inter_node_bytes_per_step": nbytes, "counted_inter_node_bytes_per_step": nbytes,
                    "host_cache_bytes_per_rank": 0, "device_cache_bytes_per_rank": 0, "peak_memory_bytes": 0,
                    "computed": True})
    return out


def add_ratios(rows: list[dict]) -> list[dict]:
    """Throughput and byte ratios against ZeRO-3, hpZ and the bound row at the same rate, and against
    the no-network bound (the fastest engine of that job on the unlimited network)."""
    by = {(r["rate_mbit"], _job_key(r), r["engine"]): r for r in rows}
    for r in rows:
        for ref, label in (("zero3", "zero3"), ("hpz", "hpz"), ("bound", "bound"), (EXACT_ENGINE, "exact")):
            other = by.get((r["rate_mbit"], _job_key(r), ref))
            ok = other is not None and other["samples_per_s"] and r["samples_per_s"]
            r[f"speedup_vs_{label}"] = r["samples_per_s"] / other["samples_per_s"] if ok else None
            theirs = other["kernel_inter_node_bytes_per_step"] if other else 0
            r[f"bytes_vs_{label}"] = r["kernel_inter_node_bytes_per_step"] / theirs if theirs else None
        measured = [x["samples_per_s"] for x in rows if _job_key(x) == _job_key(r) and x["rate_mbit"] == 0
                    and not x.get("computed")]
        r["fraction_of_no_network_bound"] = r["samples_per_s"] / max(measured) if measured and r["samples_per_s"] else None
        k = r["kernel_inter_node_bytes_per_step"]
        r["counted_vs_kernel"] = r["counted_inter_node_bytes_per_step"] / k if k and not r.get("computed") else None
    return add_step_floor(rows, _job_key)


def _launcher_env(ranks_per_node: int) -> dict[str, str]:
    """What DeepSpeed's launcher puts in every rank's environment that the bench's ranks need.

    [Note: LOCAL_SIZE as the launcher sets it] DeepSpeed's launcher (``launcher/launch.py``) sets ``LOCAL_SIZE`` to the
    ranks per node, and DeepSpeed's CPU accelerator answers ``device_count()`` from it; without it, each call runs
    ``numactl`` in a subprocess, and ZeRO-3 calls it once per gradient bucket (``__avg_scatter_grads``): about 1.5 ms
    per bucket on rank 0 here, ten buckets a step at FCDP's default bucket size, one for ZeRO-3's (profiled, session
    2026-12-04f). On an accelerator ``device_count`` is cheap."""
    return {"LOCAL_SIZE": str(ranks_per_node)}


def _sampler(cluster: Any, on: bool) -> Any:
    """A :class:`~fcdp_lab.harness.links.LinkSampler` on ``cluster`` when ``on``, else nothing."""
    from contextlib import nullcontext

    from fcdp_lab.harness.links import LinkSampler
    return LinkSampler(cluster) if on else nullcontext()


def _links_of(samples: list, record: dict, rate: float) -> Optional[dict]:
    """What the uplinks did in ``record``'s traced step ([Note: link samples])."""
    from fcdp_lab.harness.links import link_use, step_window
    window = step_window(record.get("trace_last_step") or [])
    return None if window is None else link_use(samples, *window, rate)


def links_markdown(rows: list[dict]) -> str:
    """One line per row with link samples: the traced step against its busiest uplink's floor."""
    lines = ["| bandwidth | layout | job | GA | engine | traced step (s) | busiest uplink | its bytes at the rate (s) | "
             "busy share | its idle (s) | idle spans (s from the step's start) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        use = r.get("links_last_step")
        if not use:
            continue
        node, way = use["busiest"].split()[1:]
        spans = use["nodes"][int(node)][way]["idle_spans"]
        lines.append(f"| {_rate_label(r['rate_mbit'])} | {_layout(r)} | {r['job']} | {r.get('grad_accum', 1)} | "
                     f"{r['engine']} | {use['step_s']:.3f} | {use['busiest']} | {use['floor_s']:.3f} | "
                     f"{use['busiest_utilisation']:.2f} | {use['busiest_idle_s']:.3f} | "
                     f"{', '.join(f'{a:.3f}-{b:.3f}' for a, b in spans) or '-'} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def run_bench(spec: BenchSpec, out_dir: Path, progress: bool = True) -> list[dict]:
    from fcdp_lab.harness.cluster import EmulatedCluster
    from fcdp_lab.harness.launch import run_local

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "runs.jsonl").unlink(missing_ok=True)
    rows: list[dict] = []
    layouts = spec.layout_list()
    tasks = [(lay, rate, job, ga, rep, engine) for lay in layouts for rate in spec.rates_mbit for job in spec.jobs
             for ga in spec.grad_accums for rep in range(spec.repeats) for engine in spec.engines]
    bar = _progress(progress, len(tasks))
    started = time.time()
    runs: dict[tuple, list[dict]] = {}
    try:
        for (nodes, per_node), rate, job, ga, rep, engine in tasks:
            where = f"{nodes}x{per_node}, " if len(layouts) > 1 else ""
            bar.update(f"{where}{_rate_label(rate)}, {job}, GA {ga}, {engine} (repeat {rep + 1}/{spec.repeats})")
            base, before = engine.removesuffix(BEFORE), engine.endswith(BEFORE)
            one = asdict(spec) | {"engines": [base], "grad_accum": ga, "nodes": nodes, "ranks_per_node": per_node,
                                  "layouts": []}
            if before:  # the other checkout's rank_main takes the fields it knows
                one = {k: v for k, v in one.items() if k not in BenchSpec.DRIVER_ONLY}
            with EmulatedCluster(nodes, rate_mbit=rate or None, tag="b") as cluster, \
                    _sampler(cluster, spec.sample_links and bool(rate)) as sampler:
                record = run_local("fcdp_lab.bench.bench:rank_main", nodes * per_node,
                                   {"spec": one, "job": job}, timeout=spec.timeout_s, cluster=cluster,
                                   env=_launcher_env(per_node),
                                   pythonpath=[spec.before_src] if before else [])[0][0]
            if sampler is not None:
                record["links_last_step"] = _links_of(sampler.samples, record, rate)
            record["engine"] = engine
            runs.setdefault((nodes, per_node, rate, job, ga, engine), []).append(record)
            # Raw records as they arrive, so a long sweep cut short keeps what it measured.
            with open(out_dir / "runs.jsonl", "a") as f:
                f.write(json.dumps({"layout": f"{nodes}x{per_node}", "rate": rate, "job": job, "grad_accum": ga,
                                    "engine": engine, "record": record}) + "\n")
            bar.advance()
    finally:
        bar.close()
    for (_, _, rate, job, ga, engine), repeats in runs.items():
        rows.append(_combine(repeats, rate, spec))
    rows += bound_rows(rows)
    add_ratios(rows)
    finished = time.time()
    # "date" (the end, local time) kept for the committed results that have only it
    meta = {"spec": asdict(spec), "seconds": finished - started, "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(finished)), "started_utc": _utc(started),
            "finished_utc": _utc(finished)}
    write_results(rows, meta, out_dir)
    return rows


def run_preset(name: str, base: BenchSpec, out_dir: Path, progress: bool = True) -> tuple[list[dict], list[dict]]:
    """Every sweep of ``PRESETS[name]`` (``base`` with that part's overrides) into ``out_dir/<part>``; the targets
    they decide, checked on all their rows together, in ``out_dir/targets.json`` and ``targets.md``."""
    rows: list[dict] = []
    found: list[dict] = []
    for part_name, part in PRESETS[name].items():
        print(f"python -m fcdp_lab bench --preset {name}: part {part_name}", flush=True)
        part_rows = run_bench(replace(base, **part.overrides), out_dir / part_name, progress=progress)
        rows += part_rows
        found += [t | {"part": part_name} for t in targets(part_rows, part.decides)]
    (out_dir / "targets.json").write_text(json.dumps(found, indent=1))
    (out_dir / "targets.md").write_text(targets_markdown(found))
    return rows, found


class _progress:
    """A rich progress bar when stdout is a terminal and rich is installed; plain lines otherwise."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar = None
        self.done = 0
        self.total = total
        if enabled:
            try:
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
                self.bar = Progress(TextColumn("[bold]bench"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                    TimeElapsedColumn(), TextColumn("{task.description}"))
                self.task = self.bar.add_task("", total=total)
                self.bar.start()
            except ImportError:
                pass

    def update(self, label: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=label)
        else:
            print(f"[bench {self.done + 1}/{self.total}] {label}", flush=True)

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


COLUMNS = ["rate_mbit", "layout", "job", "grad_accum", "engine", "regime", "param_compression", "grad_compression",
           "step_time_s", "samples_per_s", "speedup_vs_zero3", "speedup_vs_hpz", "speedup_vs_exact",
           "fraction_of_no_network_bound", "kernel_inter_node_bytes_per_step",
           "counted_inter_node_bytes_per_step", "counted_vs_kernel", "bytes_vs_zero3", "bytes_vs_hpz", "bytes_vs_bound",
           "bytes_vs_exact", "compute_s", "wire_s", "wire_frames_s", "step_vs_floor",
           "host_cache_bytes_per_rank", "grad_buffer_host_bytes_per_rank", "device_cache_bytes_per_rank",
           "peak_memory_bytes"]


def write_results(rows: list[dict], meta: dict, out_dir: Path) -> None:
    """bench.json (rows, and issue 23's targets where the run decides any), .csv, .png, .md."""
    doc = {"meta": meta, "rows": rows}
    found = targets(rows)
    if found:
        doc["targets"] = found
    (out_dir / "bench.json").write_text(json.dumps(doc, indent=1))
    with open(out_dir / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, out_dir / "bench.png")
    links = links_markdown(rows)
    (out_dir / "bench.md").write_text(markdown_table(rows) + ("\n" + targets_markdown(found) if found else "") +
                                      ("\n" + links if links else ""))


def _rate_label(rate: float) -> str:
    return "unlimited" if not rate else (f"{rate / 1000:g} Gbit/s" if rate >= 1000 else f"{rate:g} Mbit/s")


def markdown_table(rows: list[dict]) -> str:
    """One line per row; ``vs exact`` is against ``fcdp_node`` (the exact defaults), ``step / floor`` is
    ``step_vs_floor`` (tools/bench/compression.py)."""
    lines = ["| bandwidth | layout | job | GA | engine | step time (s) | samples/s | vs ZeRO-3 | vs hpZ | vs exact | "
             "of no-network bound | inter-node MB/step (kernel) | bytes vs ZeRO-3 | bytes vs hpZ | bytes vs bound | "
             "bytes vs exact | step / max(compute, wire) | counted/kernel | cache host MiB/rank | grad buffer MiB/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    order = {e: i for i, e in enumerate((*ALL_ENGINES, "bound"))}
    for r in sorted(rows, key=lambda r: (r["rate_mbit"] == 0, r["rate_mbit"], r.get("nodes", 2), r.get("world", 4),
                                         r["job"], r.get("grad_accum", 1), order.get(r["engine"], 99))):
        lines.append(f"| {_rate_label(r['rate_mbit'])} | {_layout(r)} | {r['job']} | {r.get('grad_accum', 1)} | {r['engine']} | "
                     f"{r['step_time_s']:.3f} | {fmt(r['samples_per_s'], '.1f')} | {fmt(r['speedup_vs_zero3'], '.2f')}x | "
                     f"{fmt(r['speedup_vs_hpz'], '.2f')}x | {fmt(r.get('speedup_vs_exact'), '.2f')}x | "
                     f"{fmt(r['fraction_of_no_network_bound'], '.0%')} | "
                     f"{r['kernel_inter_node_bytes_per_step'] / 1e6:.2f} | {fmt(r['bytes_vs_zero3'], '.3f')} | "
                     f"{fmt(r['bytes_vs_hpz'], '.3f')} | {fmt(r['bytes_vs_bound'], '.2f')} | "
                     f"{fmt(r.get('bytes_vs_exact'), '.3f')} | {fmt(r.get('step_vs_floor'), '.2f')} | "
                     f"{fmt(r['counted_vs_kernel'], '.3f')} | {r['host_cache_bytes_per_rank'] / 2**20:.1f} | "
                     f"{r.get('grad_buffer_host_bytes_per_rank', 0) / 2**20:.2f} |")
    return "\n".join(lines) + "\n"


def _plot_bars(rows: list[dict], jobs: list, axes) -> None:
    """Single-bandwidth runs: samples/s (measured engines) and inter-node MB per step (with the bound)."""
    for col, job in enumerate(jobs):
        mine = {r["engine"]: r for r in rows if _job_key(r) == job}
        names = [e for e in (*ALL_ENGINES, "bound") if e in mine]
        for ax in (axes[0][col], axes[1][col]):
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        measured = [e for e in names if e != "bound"]
        axes[0][col].bar(measured, [mine[e]["samples_per_s"] for e in measured], color="tab:blue")
        axes[1][col].bar(names, [mine[e]["kernel_inter_node_bytes_per_step"] / 1e6 for e in names],
                         color=["tab:gray" if e == "bound" else "tab:orange" for e in names])
        for row, ylabel in ((0, "samples/s"), (1, "inter-node MB per step (kernel; bound computed)")):
            ax = axes[row][col]
            ax.set_ylabel(ylabel)
            ax.set_title(f"{_job_title(job)}, {_rate_label(rows[0]['rate_mbit'])} ({rows[0]['regime']} release regime)")
            ax.grid(alpha=0.3, axis="y")


def _job_title(job: tuple) -> str:
    name, ga, nodes, world = job
    return f"{name}, GA {ga}, {nodes}x{world // nodes}"


#: Line styles of the measured engines in :func:`plot` (``bound``: black dotted), in ALL_ENGINES order.
_STYLES = ("o-", "s--", "^-", "D-", "v--", "P-", "X-", "*--", "h--", "<:", ">:")


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    jobs = sorted({_job_key(r) for r in rows}, key=lambda j: (j[2], j[3], JOBS.index(j[0]) if j[0] in JOBS else 9, j[1]))
    fig, axes = plt.subplots(2, len(jobs), figsize=(6 * len(jobs), 8), squeeze=False)
    rates = sorted({r["rate_mbit"] for r in rows if r["rate_mbit"]})
    if len({r["rate_mbit"] for r in rows}) == 1:  # one bandwidth: bars per engine instead of lines over rates
        _plot_bars(rows, jobs, axes)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    unlimited_x = (max(rates) * 4) if rates else 1
    for col, job in enumerate(jobs):
        for i, engine in enumerate((*ALL_ENGINES, "bound")):
            style = "k:" if engine == "bound" else _STYLES[i % len(_STYLES)]
            pts = sorted(((r["rate_mbit"] or unlimited_x, r) for r in rows
                          if _job_key(r) == job and r["engine"] == engine and r["samples_per_s"]), key=lambda p: p[0])
            if not pts:
                continue
            xs = [x for x, _ in pts]
            if engine != "bound":  # the bound's "step time" is network time alone, not a throughput
                axes[0][col].plot(xs, [r["samples_per_s"] for _, r in pts], style, label=engine)
            axes[1][col].plot(xs, [r["kernel_inter_node_bytes_per_step"] / 1e6 for _, r in pts], style, label=engine)
        for row, ylabel in ((0, "samples/s"), (1, "inter-node MB per step (kernel)")):
            ax = axes[row][col]
            ax.set_xscale("log")
            ax.set_xticks(rates + [unlimited_x])
            ax.set_xticklabels([_rate_label(r) for r in rates] + ["unlimited"], rotation=30, fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{_job_title(job)} ({rows[0]['regime']} release regime)")
            ax.grid(alpha=0.3)
            ax.legend()
        axes[1][col].set_xlabel("inter-node bandwidth per node uplink")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _extra(ap: argparse.ArgumentParser, text: str) -> dict:
    """``--fcdp-extra``: a JSON object of fcdp keys, checked against the config model here (not in every rank)."""
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as err:
        ap.error(f"--fcdp-extra: not JSON ({err})")
    if not isinstance(extra, dict):
        ap.error("--fcdp-extra: expected a JSON object such as '{\"param_refresh_interval\": 0}'")
    from fcdp_deepspeed.config import FCDPConfigError, parse_fcdp_config
    try:
        parse_fcdp_config({"fcdp": {"enabled": True, **extra}})
    except FCDPConfigError as err:
        ap.error(f"--fcdp-extra: {err}")
    return extra


def main(argv: Optional[list[str]] = None) -> int:
    from fcdp_deepspeed.tools import args as checks
    ap = checks.parser("python -m fcdp_lab bench", __doc__)
    ap.add_argument("--rates", type=checks.number_list(checks.non_negative()), default=[100, 200, 1000, 10000, 0],
                    help="Mbit/s per node uplink, comma-separated, 0 = unlimited (default: 100,200,1000,10000,0)")
    ap.add_argument("--jobs", type=checks.choice_list(("full", "lora")), default=["full", "lora"],
                    help="comma-separated, of full, lora (default: full,lora)")
    ap.add_argument("--engines", type=checks.choice_list((*ALL_ENGINES, *(e + BEFORE for e in ALL_ENGINES))),
                    default=list(ENGINES), help=f"comma-separated, of {', '.join(ALL_ENGINES)} (default: "
                    f"{','.join(ENGINES)}); ENGINE{BEFORE} runs that engine from --before-src, in the same run")
    ap.add_argument("--before-src", default="", help="a source tree with the fcdp_deepspeed package (e.g. "
                    "`git archive COMMIT | tar -x -C DIR`) that the ENGINE@before engines run from")
    ap.add_argument("--nodes", type=checks.whole(2), default=2, help="emulated nodes")
    ap.add_argument("--ranks-per-node", type=checks.whole(1), default=2, help="ranks per emulated node")
    ap.add_argument("--layout", default="", help="NODESxRANKS layouts to sweep, e.g. 2x2,2x4,4x2 (overrides --nodes "
                    "and --ranks-per-node; default: none)")
    ap.add_argument("--hidden", type=checks.whole(1), default=512, help="toy model width")
    ap.add_argument("--layers", type=checks.whole(1), default=8, help="toy model depth")
    ap.add_argument("--lora-rank", type=checks.whole(1), default=2, help="LoRA adapter rank (lora job)")
    ap.add_argument("--micro-batch", type=checks.whole(1), default=8, help="samples per rank and micro-step")
    ap.add_argument("--grad-accum", type=checks.number_list(checks.whole(1)), default=[1],
                    help="gradient accumulation steps to sweep, e.g. 1,4 (default: 1)")
    ap.add_argument("--warmup", type=checks.whole(0), default=2, help="untimed steps per run")
    ap.add_argument("--steps", type=checks.whole(1), default=5, help="timed steps per run")
    ap.add_argument("--repeats", type=checks.whole(1), default=3, help="fresh-process runs per engine, interleaved")
    ap.add_argument("--regime", choices=["large", "prefetch", "default"], default="large",
                    help="DeepSpeed release regime (prefetch: DeepSpeed's prefetch bucket, reuse distance 0)")
    ap.add_argument("--param-gather", choices=["flat", "hierarchical", "auto"], default="auto",
                    help="fcdp.param_gather of the FCDP engines")
    ap.add_argument("--compression-block", type=checks.whole(8), default=128,
                    help="fcdp.compression_block of the compressed engines")
    ap.add_argument("--fcdp-extra", default="{}", help="JSON object of more fcdp keys for every FCDP engine, "
                    "e.g. '{\"param_refresh_interval\": 0}'")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="run a named set of sweeps instead (compression: issue "
                    "23's targets; only the model, regime and --out options apply), each into OUT/<part>, and check "
                    "the targets on all of them (OUT/targets.json, OUT/targets.md)")
    ap.add_argument("--out", default="results/bench", help="output directory")
    ap.add_argument("--no-progress", action="store_true", help="no progress lines")
    ap.add_argument("--sample-links", action="store_true", help="sample every uplink's kernel counters each "
                    "millisecond at shaped rates: the traced step's busiest uplink, its busy share and idle spans "
                    "(bench.json links_last_step, bench.md); costs the driver about 6%% of a core")
    args = ap.parse_args(argv)
    # [Note: one JIT build dir per venv] as tests/conftest.py: the shared ~/.cache/torch_extensions is rebuilt by
    # every venv whose paths differ, and a killed build's lock makes every rank wait at init_distributed.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    if any(e.endswith(BEFORE) for e in args.engines) and not (Path(args.before_src) / "fcdp_deepspeed").is_dir():
        ap.error(f"--engines ...{BEFORE}: --before-src must name a tree with the fcdp_deepspeed package")
    try:
        layouts = parse_layouts(args.layout)
    except ValueError as err:
        ap.error(f"--layout: {err}")
    spec = BenchSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, layouts=layouts,
                     compression_block=args.compression_block, rates_mbit=[float(x) for x in args.rates],
                     jobs=args.jobs, engines=args.engines, hidden=args.hidden, layers=args.layers,
                     lora_rank=args.lora_rank, micro_batch=args.micro_batch, grad_accums=args.grad_accum,
                     warmup=args.warmup, steps=args.steps, repeats=args.repeats, regime=args.regime,
                     param_gather=args.param_gather, fcdp_extra=_extra(ap, args.fcdp_extra),
                     before_src=str(Path(args.before_src).resolve()) if args.before_src else "",
                     sample_links=args.sample_links)
    from fcdp_lab.harness.cluster import ClusterUnavailable
    try:
        if args.preset:
            _, found = run_preset(args.preset, spec, Path(args.out), progress=not args.no_progress)
            print(targets_markdown(found) or "no target decided by these runs")
            print(f"results: {args.out}/<part>/bench.*, {args.out}/targets.json, targets.md")
            return 0
        rows = run_bench(spec, Path(args.out), progress=not args.no_progress)
    except ClusterUnavailable as err:
        print(f"python -m fcdp_lab bench needs network namespaces: {err}")
        return 2
    print(markdown_table(rows))
    print(links_markdown(rows))
    print(f"results: {args.out}/bench.json, bench.csv, bench.png, bench.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
