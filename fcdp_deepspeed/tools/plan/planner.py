"""Size a cluster before buying time on it: per-step inter-node bytes, cache memory and step-time
lower bounds for ZeRO-3, ZeRO++ hpZ and FCDP, and a recommended ``fcdp`` block.

    fcdp plan --params 30B --nodes 4 --ranks-per-node 8 --inter-gbps 1 --trainable-fraction 0.001
    fcdp plan --config ds.json --params 7e9 --nodes 2 --ranks-per-node 8 --inter-gbps 25

Units: bytes per optimizer step are given as the **cluster total** (the sum over every node uplink) and
**per node uplink** (what one node receives; the step-time bound divides this by ``--inter-gbps``); memory
and bytes in GiB (2^30 bytes), link speeds in Gbit/s (10^9 bit/s).

Engines: ``zero3``, ``hpz`` (ZeRO++ hpZ), ``fcdp`` (node cache, DeepSpeed's gradient path:
``grad_reduce: flat``, ``grad_accumulation: rank``), ``fcdp_node`` (node cache plus
``grad_reduce: hierarchical`` and ``grad_accumulation: node``), and ``bound``: exact data parallelism's
lower bound, each node receiving the trainable parameters that changed once and sending its gradient
share once per optimizer step ((N-1)/N of the trainable bytes each, per node).

The byte model is validated against the emulated cluster's kernel counters (``tests/test_planner.py``
checks every benchmark run within 10%). Assumptions: ranks numbered node-major, ring all-gather and
all-reduce (each ring crosses every node boundary once), DeepSpeed's large-model release regime
(every parameter re-gathered in backward unless its module needs no backward), steady state
(frozen slices already cached), flat gradients reduce-scattered every micro-step. ``--backend gloo``
models gloo's reduce-scatter, which costs a full all-reduce. The hierarchical plan's inter-node stage
moves (N-1)/N of the gradient per node on either backend: on NCCL it is a ring reduce-scatter among
the N node peers, on gloo an all-to-all of the peer chunks plus a local sum. ``--param-gather``
(``fcdp.param_gather``, default ``auto``) says how the FCDP engines gather what the cache does not
serve: ``hierarchical`` (all-gather among node peers, then inside the node: (N-1)/N of the parameter
per node uplink) or DeepSpeed's ``flat`` ring ((W-1)/W); ``auto`` is hierarchical with N > 1 and L > 1.
Compressed rows (**lossy**, ``param_compression``/``grad_compression`` int8 and int4 on top of
``fcdp_node``): ``fcdp_deepspeed/tools/plan/compression.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Optional

from fcdp_deepspeed import paths
from fcdp_deepspeed.tools import args as checks
from fcdp_deepspeed.tools.args import plural
from fcdp_deepspeed.tools.plan.compression import SETTINGS, compressed_step
from fcdp_deepspeed.tools.plan.diloco import diloco_plan, format_diloco
from fcdp_deepspeed.tools.plan.layered import activation_plan, format_activations

GBIT = 1e9 / 8  # bytes per second per Gbit/s
GIB = 2 ** 30
ENGINES = ("zero3", "hpz", "fcdp", "fcdp_node", "bound")
#: Fraction of host RAM per node the planner lets the cache use (its recommended block says so explicitly).
HOST_CACHE_FRACTION = 0.8


@dataclass(frozen=True)
class ClusterSpec:
    params: float
    """Total parameters."""
    nodes: int
    ranks_per_node: int
    trainable_fraction: float = 1.0
    grad_accum: int = 1
    dtype_bytes: int = 2
    inter_gbps: float = 10.0
    """Per node uplink."""
    intra_gbps: float = 1200.0
    """Per accelerator, inside a node (NVLink ~ 1200-3600, PCIe switch ~ 200-500)."""
    pcie_gbps: float = 200.0
    """Host <-> accelerator per accelerator (PCIe 4 x16 ~ 200)."""
    host_ram_bytes: float = 1024.0 * GIB
    """Per node."""
    device_mem_bytes: float = 80.0 * GIB
    """Per accelerator, total."""
    device_used_bytes: Optional[float] = None
    """Per accelerator at the peak of a ZeRO-3 step (default: unknown, assume 80% of total)."""
    no_backward_fraction: float = 0.0
    """Fraction of all parameters whose modules need no backward (frozen, and their inputs carry no
    grad: embeddings, frozen layers before the first adapter). ZeRO-3 does not re-gather them."""
    regime: str = "large"
    backend: str = "nccl"
    compute_s: float = 0.0
    """Optional compute time per micro-step, for the step-time bound."""
    param_gather: str = "auto"
    """``fcdp.param_gather`` of the FCDP engines: ``flat``, ``hierarchical`` or ``auto``."""
    compression_block: int = 128
    """``fcdp.compression_block`` of the compressed rows."""
    latency_us: float = 50.0
    """One step of a ring collective, its fixed time in microseconds (NCCL ~ tens; gloo on the emulated cluster ~ 600)."""
    fetch_bytes: Optional[float] = None
    """The model's mean per-module parameter bytes, one fetch (default: the model over 200 modules, a transformer of
    ~30 layers of ~7 parameter-owning modules)."""
    link: str = "probe"
    """``fcdp.link``: ``probe`` predicts what the engine's probe will choose on this cluster; ``slow``/``fast``."""
    diloco: Optional[dict] = None
    """The config's ``fcdp.diloco`` block (``tools/plan/diloco.py``): adds the DiLoCo rows."""
    layered_chunks: int = 1
    """``fcdp.layered``'s chunks (1: off); with ``layers``, ``hidden``, ``seq`` and ``batch``, the activation rows."""
    layers: Optional[int] = None
    hidden: Optional[int] = None
    seq: Optional[int] = None
    batch: Optional[int] = None
    """Examples per rank per optimizer step (the window: micro-batch x accumulation steps)."""

    def __post_init__(self) -> None:
        problems = [f"{name} = {getattr(self, name)!r}: {why}" for name, ok, why in (
            ("params", self.params > 0, "must be > 0"),
            ("nodes", isinstance(self.nodes, int) and self.nodes >= 1, "must be a whole number >= 1"),
            ("ranks_per_node", isinstance(self.ranks_per_node, int) and self.ranks_per_node >= 1,
             "must be a whole number >= 1"),
            ("trainable_fraction", 0 < self.trainable_fraction <= 1, "must be in (0, 1]"),
            ("no_backward_fraction", 0 <= self.no_backward_fraction <= 1 - self.trainable_fraction,
             "must be in [0, 1 - trainable_fraction] (only frozen parameters can skip backward)"),
            ("grad_accum", isinstance(self.grad_accum, int) and self.grad_accum >= 1, "must be a whole number >= 1"),
            ("dtype_bytes", self.dtype_bytes in (1, 2, 4, 8), "must be 1, 2, 4 or 8"),
            ("inter_gbps", self.inter_gbps > 0, "must be > 0"), ("intra_gbps", self.intra_gbps > 0, "must be > 0"),
            ("pcie_gbps", self.pcie_gbps > 0, "must be > 0"), ("host_ram_bytes", self.host_ram_bytes >= 0, "must be >= 0"),
            ("device_mem_bytes", self.device_mem_bytes > 0, "must be > 0"),
            ("device_used_bytes", self.device_used_bytes is None or 0 <= self.device_used_bytes <= self.device_mem_bytes,
             "must be between 0 and device_mem_bytes"),
            ("compute_s", self.compute_s >= 0, "must be >= 0"),
            ("regime", self.regime in ("large", "default"), "must be large or default"),
            ("backend", self.backend in ("nccl", "gloo"), "must be nccl or gloo"),
            ("param_gather", self.param_gather in ("flat", "hierarchical", "auto"), "must be flat, hierarchical or auto"),
            ("compression_block", self.compression_block >= 8 and self.compression_block % 2 == 0,
             "must be an even number >= 8"), ("latency_us", self.latency_us >= 0, "must be >= 0"),
            ("fetch_bytes", self.fetch_bytes is None or self.fetch_bytes > 0, "must be > 0"),
            ("link", self.link in ("probe", "slow", "fast"), "must be probe, slow or fast"),
            ("layered_chunks", isinstance(self.layered_chunks, int) and self.layered_chunks >= 1,
             "must be a whole number >= 1"),
            *((name, getattr(self, name) is None or getattr(self, name) >= 1, "must be a whole number >= 1")
              for name in ("layers", "hidden", "seq", "batch"))) if not ok]
        if problems:
            raise ValueError("invalid cluster spec: " + "; ".join(problems))

    @property
    def hierarchical_gather(self) -> bool:
        """Whether the FCDP engines gather misses in two stages (``auto``: several nodes of several ranks)."""
        return self.param_gather != "flat" and self.nodes > 1 and self.ranks_per_node > 1

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def one_fetch_bytes(self) -> float:
        return self.fetch_bytes if self.fetch_bytes is not None else self.params * self.dtype_bytes / 200


def choose_paths(spec: ClusterSpec) -> dict:
    """The paths the engine will run on this cluster (``fcdp.link``, the rule of ``fcdp_deepspeed/paths.py`` on the
    times :func:`~fcdp_deepspeed.paths.modeled_times` gives), and its step against ZeRO-3's: ``1.0`` on ZeRO-3's
    paths, else the ratio of the step-time bounds of ``fcdp_node`` (the defaults) and ``zero3``."""
    if spec.nodes == 1 or spec.ranks_per_node == 1:
        return {"paths": "fcdp", "why": "one node or one rank per node: no two-stage path to weigh"}
    if spec.link != "probe":
        choice = paths.declared(spec.link)
    else:
        choice = paths.choose(paths.modeled_times(int(spec.one_fetch_bytes), spec.nodes, spec.ranks_per_node,
                                                  spec.inter_gbps * GBIT, spec.intra_gbps * GBIT, spec.latency_us * 1e-6))
    return {"paths": choice.paths.value, "why": choice.why}


def _ring_allgather(spec: ClusterSpec, nbytes: float) -> float:
    """Total bytes over all inter-node links for one ring all-gather of a tensor of ``nbytes``."""
    w, crossings = spec.world, spec.nodes if spec.nodes > 1 else 0
    return crossings * (w - 1) / w * nbytes


def _miss_allgather(spec: ClusterSpec, nbytes: float) -> float:
    """Total inter-node bytes (all uplinks) for an FCDP gather of what the cache does not serve: the
    two-stage gather crosses nodes only in its node-peer stage, (N-1)/N of the tensor into each
    node; otherwise DeepSpeed's flat ring."""
    if spec.hierarchical_gather:
        return (spec.nodes - 1) * nbytes
    return _ring_allgather(spec, nbytes)


def _reduce_scatter(spec: ClusterSpec, nbytes: float) -> float:
    factor = 2 if spec.backend == "gloo" else 1  # gloo: a full ring all-reduce
    return factor * _ring_allgather(spec, nbytes)


def inter_node_bytes_per_step(spec: ClusterSpec, engine: str, cached_fraction: float = 1.0) -> dict:
    """Bytes crossing node uplinks (sum over nodes) per optimizer step, steady state."""
    m = spec.params * spec.dtype_bytes
    t = m * spec.trainable_fraction
    frozen = m - t
    ga = spec.grad_accum
    backward_frozen = max(0.0, frozen - spec.params * spec.no_backward_fraction * spec.dtype_bytes)
    rs = ga * _reduce_scatter(spec, t)
    peers = (spec.nodes - 1) * t  # one exchange among node peers: (N-1)/N of t per node uplink
    if engine == "bound":
        return {"allgather": peers, "reduce_scatter": peers, "total": 2 * peers}
    if engine == "fcdp_node":
        rs = peers if spec.nodes > 1 and spec.ranks_per_node > 1 else rs  # degenerate layouts: flat
        engine = "fcdp"
    if engine == "zero3":
        fwd = ga * _ring_allgather(spec, m)
        bwd = ga * _ring_allgather(spec, t + backward_frozen) if spec.regime == "large" else 0.0
        ag = fwd + bwd
    elif engine in ("hpz", "fcdp"):
        # trainable: only the first forward after each step crosses nodes; frozen: never (cached).
        gather = _miss_allgather if engine == "fcdp" else _ring_allgather
        ag = gather(spec, t)
        if engine == "fcdp" and cached_fraction < 1.0:  # parameters over the host budget: every fetch gathers
            un = 1.0 - cached_fraction
            ag = ag * cached_fraction + un * ga * (gather(spec, m) + (
                gather(spec, t + backward_frozen) if spec.regime == "large" else 0.0))
    else:
        raise ValueError(f"unknown engine {engine!r}")
    return {"allgather": ag, "reduce_scatter": rs, "total": ag + rs}


def _seconds(spec: ClusterSpec, cluster_bytes: float) -> tuple[float, float]:
    """(bytes per node uplink, seconds at ``inter_gbps``) for ``cluster_bytes`` summed over the uplinks."""
    per_uplink = cluster_bytes / spec.nodes if spec.nodes > 1 else 0.0
    return per_uplink, per_uplink / (spec.inter_gbps * GBIT)


def plan(spec: ClusterSpec) -> dict:
    """Bytes, memory and step-time lower bounds per engine, the compressed rows, and a recommended ``fcdp`` block."""
    m = spec.params * spec.dtype_bytes
    t = m * spec.trainable_fraction
    L, ga = spec.ranks_per_node, spec.grad_accum
    slice_per_rank = m / L
    host_per_node = m  # L slices of 1/L: one copy of the model per node
    host_budget = HOST_CACHE_FRACTION * spec.host_ram_bytes
    cached_fraction = min(1.0, host_budget / host_per_node) if host_per_node else 1.0
    device_total = spec.device_mem_bytes
    device_used = spec.device_used_bytes if spec.device_used_bytes is not None else 0.8 * device_total
    headroom = max(0.0, device_total - device_used)
    grad_buffer_per_node = spec.params * spec.trainable_fraction * 4  # fp32, 1/L of the trainable per rank
    out: dict = {"spec": asdict(spec), "engines": {}}
    for engine in ENGINES:
        cached = engine in ("fcdp", "fcdp_node")
        nbytes = inter_node_bytes_per_step(spec, engine, cached_fraction if cached else 1.0)
        per_uplink, inter_s = _seconds(spec, nbytes["total"])
        # cache-served gathers: frozen every fetch (fwd+bwd), trainable all but the first forward
        hit_bytes = (2 * ga * (m - t) + (2 * ga - 1) * t) if engine not in ("zero3", "bound") else 0.0
        intra_fetch_bytes = hit_bytes
        if cached and spec.hierarchical_gather:  # misses: stage 2 of the two-stage gather runs inside the node
            intra_fetch_bytes += nbytes["allgather"] / (spec.nodes - 1)  # stage 1 moved (N-1) x the missed bytes
        intra_s = intra_fetch_bytes * (L - 1) / L / (spec.intra_gbps * GBIT)
        pcie_s = (hit_bytes / L + t / L) / (spec.pcie_gbps * GBIT) if cached else 0.0
        if engine == "fcdp_node":  # stage 1 inside the node every micro-step, the fp32 buffer over PCIe
            intra_s += ga * t * (L - 1) / L / (spec.intra_gbps * GBIT)
            pcie_s += ga * grad_buffer_per_node / L / (spec.pcie_gbps * GBIT)
        bound = max(inter_s, intra_s, pcie_s, spec.compute_s * ga)
        device_extra = slice_per_rank if engine == "hpz" else 0.0
        out["engines"][engine] = {
            "inter_node_bytes_per_step": nbytes["total"],
            "inter_node_bytes_per_uplink_per_step": per_uplink,
            "inter_node_allgather_bytes_per_step": nbytes["allgather"],
            "inter_node_reduce_scatter_bytes_per_step": nbytes["reduce_scatter"],
            "inter_node_seconds": inter_s, "intra_node_seconds": intra_s, "pcie_seconds": pcie_s,
            "step_time_lower_bound_s": bound,
            "cache_host_bytes_per_node": host_per_node * cached_fraction if cached else 0.0,
            "grad_buffer_host_bytes_per_node": grad_buffer_per_node if engine == "fcdp_node" and ga > 1 else 0.0,
            "cache_device_bytes_per_rank": device_extra,
            "device_fits": device_extra <= headroom,
        }
    out["compressed"] = compressed_rows(spec, out["engines"]["fcdp_node"], cached_fraction)
    out["paths"] = choose_paths(spec)
    zero3_s = out["engines"]["zero3"]["step_time_lower_bound_s"]
    out["paths"]["fcdp_vs_zero3_step"] = (1.0 if out["paths"]["paths"] == "zero3" or not zero3_s else
                                          out["engines"]["fcdp_node"]["step_time_lower_bound_s"] / zero3_s)
    block: dict = {"enabled": True, "cache_device": "host"}
    if slice_per_rank <= 0.5 * headroom:
        block["cache_device"] = "auto"  # spare accelerator memory can hold the slices after step 1
    block["host_budget"] = f"{math.ceil(min(host_per_node * 1.05, host_budget) / GIB)}GiB"
    if out["paths"]["paths"] == "zero3":
        block = {"enabled": True}  # a path key would skip the probe, which keeps ZeRO-3's paths here
    elif spec.nodes > 1 and L > 1:
        # the gradient's inter-node bytes drop to (N-1)/N per node; with accumulation, once per step
        block["grad_reduce"] = "hierarchical"
        if ga > 1 and host_per_node * cached_fraction + grad_buffer_per_node <= host_budget:
            block["grad_accumulation"] = "node"
            block["grad_buffer_budget"] = f"{math.ceil(grad_buffer_per_node * 1.05 / GIB)}GiB"
    out["recommended_fcdp_block"] = block
    out["cached_fraction"] = cached_fraction
    if spec.diloco is not None:
        out["diloco"] = diloco_plan(spec, spec.diloco)
    if None not in (spec.layers, spec.hidden, spec.seq, spec.batch):
        chunks = spec.layered_chunks if spec.layered_chunks > 1 else spec.grad_accum
        out["activations"] = activation_plan(spec.layers, spec.hidden, spec.seq, spec.batch, chunks, spec.dtype_bytes)
    return out


def compressed_rows(spec: ClusterSpec, node: dict, cached_fraction: float) -> list[dict]:
    """``fcdp_node`` with each compression setting: its exact trainable stages replaced by the compressed
    ones (:func:`~fcdp_deepspeed.tools.plan.compression.compressed_step`); empty where the two-stage paths
    do not run (one node, one rank per node, or ``param_gather: flat`` for the parameter stage)."""
    if spec.nodes <= 1 or spec.ranks_per_node <= 1:
        return []
    trainable = spec.params * spec.trainable_fraction
    common = dict(nodes=spec.nodes, ranks_per_node=spec.ranks_per_node, trainable_numel=trainable,
                  dtype_bytes=spec.dtype_bytes, block=spec.compression_block)
    exact = compressed_step(**common)
    rows = []
    for param_c, grad_c in SETTINGS:
        if param_c != "off" and not spec.hierarchical_gather:
            continue
        c = compressed_step(param_compression=param_c, grad_compression=grad_c, **common)
        # only the cached (changed-once-per-step) share of the parameter stage is compressed
        allgather = node["inter_node_allgather_bytes_per_step"] - cached_fraction * (
            exact["param_stage_bytes"] - c["param_stage_bytes"])
        reduce = node["inter_node_reduce_scatter_bytes_per_step"] - exact["grad_stage_bytes"] + c["grad_stage_bytes"]
        total = allgather + reduce
        per_uplink, inter_s = _seconds(spec, total)
        other_s = max(node["intra_node_seconds"], node["pcie_seconds"], spec.compute_s * spec.grad_accum)
        rows.append({"param_compression": param_c, "grad_compression": grad_c,
                     "inter_node_bytes_per_step": total, "inter_node_bytes_per_uplink_per_step": per_uplink,
                     "inter_node_allgather_bytes_per_step": allgather, "inter_node_reduce_scatter_bytes_per_step": reduce,
                     "inter_node_seconds": inter_s, "step_time_lower_bound_s": max(inter_s, other_s),
                     "reference_bytes_per_rank": c["reference_bytes_per_rank"],
                     "residual_bytes_per_rank": c["residual_bytes_per_rank"]})
    return rows


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'30B', '7e9', '125M', '1.3b' -> float (> 0)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    value = float(m.group(1)) * _SUFFIX.get(m.group(2), 1.0) if m else 0.0
    if not m or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a parameter count > 0 such as 30B, 7e9 or 125M, got {text!r}")
    return value


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f}"


def format_plan(result: dict, assumptions: Optional[list[str]] = None) -> str:
    s = result["spec"]
    gather = "hierarchical" if s["param_gather"] != "flat" and s["nodes"] > 1 and s["ranks_per_node"] > 1 else "flat"
    lines = [f"{s['params'] / 1e9:.2f}B params x {s['dtype_bytes']} B ({_gib(s['params'] * s['dtype_bytes'])} GiB), "
             f"{plural(s['nodes'], 'node')} x {plural(s['ranks_per_node'], 'rank')}, trainable {s['trainable_fraction']:.2%}, GA "
             f"{s['grad_accum']}, {s['inter_gbps']:g} Gbit/s per node uplink, {s['backend']} collectives, "
             f"{s['regime']} release regime, FCDP miss gather {gather}", ""]
    lines += ["inter-node bytes per optimizer step, GiB: 'cluster' = summed over all node uplinks, 'per uplink' = "
              "into one node (the step bound divides it by the uplink speed); memory in GiB",
              f"{'engine':<9} {'cluster':>11} {'per uplink':>11} {'vs ZeRO-3':>10} {'all-gather':>11} "
              f"{'step >= (s)':>12} {'host cache':>11} {'grad buffer':>12} {'extra device':>13}",
              f"{'':<9} {'GiB':>11} {'GiB':>11} {'total':>10} {'vs ZeRO-3':>11} {'':>12} {'GiB/node':>11} "
              f"{'GiB/node':>12} {'GiB/rank':>13}"]
    base = result["engines"]["zero3"]["inter_node_bytes_per_step"] or 1.0
    base_ag = result["engines"]["zero3"]["inter_node_allgather_bytes_per_step"] or 1.0
    for name, e in result["engines"].items():
        lines.append(f"{name:<9} {_gib(e['inter_node_bytes_per_step']):>11} {_gib(e['inter_node_bytes_per_uplink_per_step']):>11} "
                     f"{e['inter_node_bytes_per_step'] / base:>10.4f} {e['inter_node_allgather_bytes_per_step'] / base_ag:>11.4f} "
                     f"{e['step_time_lower_bound_s']:>12.3f} {_gib(e['cache_host_bytes_per_node']):>11} "
                     f"{_gib(e.get('grad_buffer_host_bytes_per_node', 0.0)):>12} "
                     f"{_gib(e['cache_device_bytes_per_rank']):>13}{'' if e['device_fits'] else '  (exceeds headroom)'}")
    lines.append("\nfcdp: node cache, DeepSpeed's gradient path; fcdp_node: plus grad_reduce hierarchical and "
                 "grad_accumulation node (the defaults); bound: changed parameters in once, gradient out once per node and step")
    if result.get("compressed"):
        node = result["engines"]["fcdp_node"]["inter_node_bytes_per_step"] or 1.0
        lines += ["", f"compressed (LOSSY) on top of fcdp_node, fcdp.param_compression / fcdp.grad_compression, "
                  f"block {s['compression_block']}; extra memory per rank: references (param) and residuals (grad)",
                  f"{'param':<6} {'grad':<5} {'cluster':>11} {'per uplink':>11} {'vs':>10} {'vs ZeRO-3':>10} "
                  f"{'step >= (s)':>12} {'references':>11} {'residuals':>10}",
                  f"{'':<6} {'':<5} {'GiB':>11} {'GiB':>11} {'fcdp_node':>10} {'total':>10} {'':>12} "
                  f"{'GiB/rank':>11} {'GiB/rank':>10}"]
        for r in result["compressed"]:
            lines.append(f"{r['param_compression']:<6} {r['grad_compression']:<5} {_gib(r['inter_node_bytes_per_step']):>11} "
                         f"{_gib(r['inter_node_bytes_per_uplink_per_step']):>11} {r['inter_node_bytes_per_step'] / node:>10.4f} "
                         f"{r['inter_node_bytes_per_step'] / base:>10.4f} {r['step_time_lower_bound_s']:>12.3f} "
                         f"{_gib(r['reference_bytes_per_rank']):>11} {_gib(r['residual_bytes_per_rank']):>10}")
    lines += format_diloco(result.get("diloco"), result["engines"]["bound"]["inter_node_bytes_per_step"])
    lines += format_activations(result.get("activations"))
    chosen = result.get("paths")
    if chosen:
        whose = "FCDP's" if chosen["paths"] == "fcdp" else "ZeRO-3's"
        ratio = chosen.get("fcdp_vs_zero3_step")
        lines += ["", f"paths (fcdp.link): {whose}: {chosen['why']}"
                  + (f"; predicted step {ratio:.2f}x ZeRO-3's" if ratio is not None else "")]
    if result["cached_fraction"] < 1.0:
        lines.append(f"\nhost RAM holds {result['cached_fraction']:.0%} of the cache; the rest runs as plain ZeRO-3.")
    if assumptions:
        lines += ["", "assumptions (* = default; change them with the options of `fcdp plan --help`):"]
        lines += [f"  {a}" for a in assumptions]
    lines += ["", "recommended block:", json.dumps({"fcdp": result["recommended_fcdp_block"]})]
    return "\n".join(lines)


#: Options with a default: (flag, type checker, default, help). Defaults are filled in after parsing, so
#: the assumptions can say which values were given and which are defaults.
_OPTIONS = (
    ("--inter-gbps", checks.positive(), 10.0, "inter-node link speed per node uplink, Gbit/s"),
    ("--intra-gbps", checks.positive(), 1200.0, "intra-node speed per accelerator, Gbit/s (NVLink ~1200-3600)"),
    ("--pcie-gbps", checks.positive(), 200.0, "host <-> accelerator speed per accelerator, Gbit/s (PCIe 4 x16 ~200)"),
    ("--host-ram-gib", checks.non_negative(), 1024.0, "host RAM per node, GiB (the cache may use 80%% of it)"),
    ("--device-mem-gib", checks.positive(), 80.0, "accelerator memory per rank, GiB"),
    ("--device-used-gib", checks.non_negative(), None, "accelerator memory per rank at the peak of a ZeRO-3 step, "
                                                       "GiB (default: unknown, 80%% of --device-mem-gib)"),
    ("--trainable-fraction", checks.fraction(), 1.0, "fraction of the parameters that train (LoRA ~0.001)"),
    ("--no-backward-fraction", checks.fraction(low_open=False), 0.0,
     "fraction of the parameters whose modules need no backward (at most the frozen fraction)"),
    ("--grad-accum", checks.whole(1), 1, "gradient accumulation steps (default: the config's, else 1)"),
    ("--dtype-bytes", checks.whole(1), 2, "bytes per parameter (default: the config's bf16/fp16 -> 2, fp32 -> 4, else 2)"),
    ("--compute-s", checks.non_negative(), 0.0, "compute seconds per micro-step, for the step-time bound"),
    ("--compression-block", checks.whole(8), 128, "fcdp.compression_block of the compressed rows (even)"),
    ("--latency-us", checks.non_negative(), 50.0, "one ring step's fixed time, microseconds (gloo on the emulator ~600)"),
    ("--fetch-mib", checks.positive(), None, "the model's mean per-module parameter MiB (default: the model / 200)"),
    ("--layered-chunks", checks.whole(1), 1, "fcdp.layered's chunks (default: the config's, else 1: off)"),
    ("--layers", checks.whole(1), None, "layers of the model, for the activation rows"),
    ("--hidden", checks.whole(1), None, "hidden size, for the activation rows"),
    ("--seq", checks.whole(1), None, "sequence length, for the activation rows"),
    ("--batch", checks.whole(1), None, "examples per rank per optimizer step (default: the config's micro-batch x GA)"),
)
_LEGACY_GB = {"--host-ram-gb": "host_ram_gib", "--device-mem-gb": "device_mem_gib", "--device-used-gb": "device_used_gib"}


def _read_config(path: str) -> dict:
    """A DeepSpeed config read with hjson, as DeepSpeed reads it; ``ValueError`` naming the problem."""
    import hjson
    try:
        with open(path) as f:
            cfg = hjson.load(f)
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    except hjson.HjsonDecodeError as err:
        raise ValueError(f"{path} is not JSON/HJSON: {err}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds {type(cfg).__name__}, not a DeepSpeed config object")
    return dict(cfg)


def _from_config(cfg: dict) -> dict:
    """What the planner takes from a DeepSpeed config: dtype bytes, accumulation steps, the block's keys."""
    out: dict = {}
    ga = cfg.get("gradient_accumulation_steps")
    if isinstance(ga, int) and not isinstance(ga, bool) and ga >= 1:  # HF's "auto" is left to --grad-accum
        out["grad_accum"] = ga
    fp16, bf16 = cfg.get("fp16") or {}, cfg.get("bf16") or {}
    half = (isinstance(bf16, dict) and bf16.get("enabled")) or (isinstance(fp16, dict) and fp16.get("enabled"))
    out["dtype_bytes"] = 2 if half else 4
    block = cfg.get("fcdp") if isinstance(cfg.get("fcdp"), dict) else {}
    if block.get("param_gather") in ("flat", "hierarchical", "auto"):
        out["param_gather"] = block["param_gather"]
    if block.get("link") in ("probe", "slow", "fast"):
        out["link"] = block["link"]
    if paths.paths_asked(block):
        out["link"] = "slow"  # a path key chooses FCDP's paths
    if isinstance(block.get("compression_block"), int):
        out["compression_block"] = block["compression_block"]
    if isinstance(block.get("diloco"), dict) and block["diloco"].get("enabled", True):
        out["diloco"] = dict(block["diloco"])
    layered = block.get("layered")
    chunks = layered.get("chunks") if isinstance(layered, dict) else layered
    if isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1:
        out["layered_chunks"] = chunks
    micro = cfg.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, int) and not isinstance(micro, bool) and micro >= 1:
        out["batch"] = micro * out.get("grad_accum", 1)
    return out


def assumptions(spec: ClusterSpec, given: set[str], from_config: set[str]) -> list[str]:
    """One line per group of inputs, each value marked ``*`` (default) or ``(config)``."""
    def mark(field: str, text: str) -> str:
        return text + (" (config)" if field in from_config else "" if field in given else "*")
    used = spec.device_used_bytes
    return [
        f"model: {mark('params', f'{spec.params:,.0f} parameters')} of {mark('dtype_bytes', f'{spec.dtype_bytes} B')}, "
        f"{mark('trainable_fraction', f'trainable fraction {spec.trainable_fraction:g}')}, "
        f"{mark('no_backward_fraction', f'no-backward fraction {spec.no_backward_fraction:g}')}, "
        f"{mark('grad_accum', f'GA {spec.grad_accum}')}, {mark('regime', f'{spec.regime} release regime')}",
        f"layout: {plural(spec.nodes, 'node')} x {plural(spec.ranks_per_node, 'rank')} per node, ranks numbered node-major; "
        f"{mark('backend', spec.backend)} ring collectives; {mark('param_gather', f'param_gather {spec.param_gather}')}",
        f"links: {mark('inter_gbps', f'{spec.inter_gbps:g} Gbit/s per node uplink')}, "
        f"{mark('intra_gbps', f'{spec.intra_gbps:g} Gbit/s per accelerator inside a node')}, "
        f"{mark('pcie_gbps', f'{spec.pcie_gbps:g} Gbit/s host <-> accelerator')}, "
        f"{mark('latency_us', f'{spec.latency_us:g} us per ring step')}, "
        f"{mark('fetch_bytes', f'{spec.one_fetch_bytes / 2**20:.1f} MiB per fetch')}",
        f"memory: {mark('host_ram_bytes', f'{spec.host_ram_bytes / GIB:g} GiB host RAM per node')} (the cache may use "
        f"{HOST_CACHE_FRACTION:.0%}), {mark('device_mem_bytes', f'{spec.device_mem_bytes / GIB:g} GiB per accelerator')}, "
        + (mark('device_used_bytes', f"{used / GIB:g} GiB of it used at a step's peak") if used is not None
           else "80% of it used at a step's peak*"),
        f"{mark('compute_s', f'compute {spec.compute_s:g} s per micro-step')}; steady state (frozen slices cached); "
        f"compressed rows: {mark('compression_block', f'block {spec.compression_block}')}",
    ]


def main(argv: Optional[list[str]] = None) -> int:
    ap = checks.parser("fcdp plan", __doc__)
    ap.add_argument("--params", type=parse_count, required=True, help="total parameters, e.g. 30B, 7e9, 125M")
    ap.add_argument("--nodes", type=checks.whole(1), required=True, help="N, nodes")
    ap.add_argument("--ranks-per-node", type=checks.whole(1), required=True, help="L, ranks (accelerators) per node")
    ap.add_argument("--config", help="DeepSpeed config (JSON/HJSON): dtype, gradient accumulation and the fcdp "
                                     "block's param_gather/compression_block/diloco are read from it")
    for flag, kind, default, text in _OPTIONS:
        shown = text if "default" in text or default is None else f"{text} (default: {default})"
        ap.add_argument(flag, type=kind, default=None, help=shown)
    for flag, dest in _LEGACY_GB.items():  # the decimal-GB spellings (docs/benchmarks.md uses them), converted
        ap.add_argument(flag, type=checks.non_negative(), default=None,
                        help=f"--{dest.replace('_', '-')} given in decimal GB (10^9 bytes) instead of GiB")
    ap.add_argument("--regime", choices=["large", "default"], default=None, help="DeepSpeed release regime (default: large)")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="collective library (default: nccl)")
    ap.add_argument("--param-gather", choices=["flat", "hierarchical", "auto"], default=None,
                    help="fcdp.param_gather of the FCDP engines, how cache misses are gathered (default: auto)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    values = {k: v for k, v in vars(args).items() if v is not None and k not in ("config", "json")}
    for flag, dest in _LEGACY_GB.items():
        legacy = values.pop(flag.lstrip("-").replace("-", "_"), None)
        if legacy is not None:
            values.setdefault(dest, legacy * 1e9 / GIB)
    config_values: dict = {}
    if args.config:
        try:
            config_values = _from_config(_read_config(args.config))
        except ValueError as err:
            ap.error(f"argument --config: {err}")
    fields = {"host_ram_gib": "host_ram_bytes", "device_mem_gib": "device_mem_bytes", "device_used_gib": "device_used_bytes"}
    if "fetch_mib" in values:
        values["fetch_bytes"] = values.pop("fetch_mib") * 2**20
    given = {fields.get(k, k) for k in values}
    spec_kwargs = {**config_values, **{fields.get(k, k): v * GIB if k in fields else v for k, v in values.items()}}
    try:
        spec = ClusterSpec(**spec_kwargs)
    except ValueError as err:
        ap.error(str(err))
    result = plan(spec)
    notes = assumptions(spec, given, set(config_values) - given)
    if args.json:
        print(json.dumps({**result, "assumptions": notes}, indent=1))
    else:
        print(format_plan(result, notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
