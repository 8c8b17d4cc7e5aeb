"""Size a cluster before buying time on it: per-step inter-node bytes, cache memory and step-time
lower bounds for ZeRO-3, ZeRO++ hpZ and FCDP, and a recommended ``fcdp`` block.

    fcdp plan --params 30B --nodes 4 --ranks-per-node 8 --inter-gbps 1 --trainable-fraction 0.001
    fcdp plan --config ds.json --params 7e9 --nodes 2 --ranks-per-node 8 --inter-gbps 25

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
"""
from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Optional

GBIT = 1e9 / 8  # bytes per second per Gbit/s
ENGINES = ("zero3", "hpz", "fcdp", "fcdp_node", "bound")


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
    host_ram_gb: float = 1024.0
    """Per node."""
    device_mem_gb: float = 80.0
    """Per accelerator, total."""
    device_used_gb: Optional[float] = None
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

    @property
    def hierarchical_gather(self) -> bool:
        """Whether the FCDP engines gather misses in two stages (``auto``: several nodes of several ranks)."""
        return self.param_gather != "flat" and self.nodes > 1 and self.ranks_per_node > 1

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


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


def plan(spec: ClusterSpec) -> dict:
    """Bytes, memory and step-time lower bounds per engine, plus a recommended ``fcdp`` block."""
    m = spec.params * spec.dtype_bytes
    t = m * spec.trainable_fraction
    L, ga = spec.ranks_per_node, spec.grad_accum
    slice_per_rank = m / L
    host_per_node = m  # L slices of 1/L: one copy of the model per node
    host_budget = 0.8 * spec.host_ram_gb * 1e9
    cached_fraction = min(1.0, host_budget / host_per_node) if host_per_node else 1.0
    device_total = spec.device_mem_gb * 1e9
    device_used = (spec.device_used_gb * 1e9) if spec.device_used_gb is not None else 0.8 * device_total
    headroom = max(0.0, device_total - device_used)
    grad_buffer_per_node = spec.params * spec.trainable_fraction * 4  # fp32, 1/L of the trainable per rank
    out: dict = {"spec": asdict(spec), "engines": {}}
    for engine in ENGINES:
        cached = engine in ("fcdp", "fcdp_node")
        nbytes = inter_node_bytes_per_step(spec, engine, cached_fraction if cached else 1.0)
        per_uplink = nbytes["total"] / spec.nodes if spec.nodes > 1 else 0.0
        inter_s = per_uplink / (spec.inter_gbps * GBIT)
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
            "inter_node_allgather_bytes_per_step": nbytes["allgather"],
            "inter_node_reduce_scatter_bytes_per_step": nbytes["reduce_scatter"],
            "inter_node_seconds": inter_s, "intra_node_seconds": intra_s, "pcie_seconds": pcie_s,
            "step_time_lower_bound_s": bound,
            "cache_host_bytes_per_node": host_per_node * cached_fraction if cached else 0.0,
            "grad_buffer_host_bytes_per_node": grad_buffer_per_node if engine == "fcdp_node" and ga > 1 else 0.0,
            "cache_device_bytes_per_rank": device_extra,
            "device_fits": device_extra <= headroom,
        }
    block: dict = {"enabled": True, "cache_device": "host"}
    if slice_per_rank <= 0.5 * headroom:
        block["cache_device"] = "auto"  # spare accelerator memory can hold the slices after step 1
    block["host_budget"] = f"{math.ceil(min(host_per_node * 1.05, host_budget) / 2**30)}GiB"
    if spec.nodes > 1 and L > 1:
        # the gradient's inter-node bytes drop to (N-1)/N per node; with accumulation, once per step
        block["grad_reduce"] = "hierarchical"
        if ga > 1 and host_per_node * cached_fraction + grad_buffer_per_node <= host_budget:
            block["grad_accumulation"] = "node"
            block["grad_buffer_budget"] = f"{math.ceil(grad_buffer_per_node * 1.05 / 2**30)}GiB"
    out["recommended_fcdp_block"] = block
    out["cached_fraction"] = cached_fraction
    return out


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'30B', '7e9', '125M', '1.3b' -> float."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 30B, 7e9, 125M)")
    return float(m.group(1)) * _SUFFIX.get(m.group(2), 1.0)


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def format_plan(result: dict) -> str:
    s = result["spec"]
    lines = [f"{s['params'] / 1e9:.2f}B params ({s['dtype_bytes']} B each), {s['nodes']} nodes x {s['ranks_per_node']} "
             f"ranks, trainable {s['trainable_fraction']:.2%}, GA {s['grad_accum']}, inter-node {s['inter_gbps']:g} "
             f"Gbit/s per node, {s['backend']} collectives, {s['regime']} release regime, FCDP miss gather "
             f"{'hierarchical' if s['param_gather'] != 'flat' and s['nodes'] > 1 and s['ranks_per_node'] > 1 else 'flat'}",
             "",
             f"{'engine':<9} {'inter-node/step':>16} {'vs ZeRO-3':>10} {'all-gather vs ZeRO-3':>21} {'step >= (s)':>12} "
             f"{'host cache/node':>16} {'grad buffer/node':>17} {'extra device/rank':>18}"]
    base = result["engines"]["zero3"]["inter_node_bytes_per_step"] or 1.0
    base_ag = result["engines"]["zero3"]["inter_node_allgather_bytes_per_step"] or 1.0
    for name, e in result["engines"].items():
        lines.append(f"{name:<9} {_gb(e['inter_node_bytes_per_step']):>16} {e['inter_node_bytes_per_step'] / base:>10.4f} "
                     f"{e['inter_node_allgather_bytes_per_step'] / base_ag:>21.4f} "
                     f"{e['step_time_lower_bound_s']:>12.3f} {_gb(e['cache_host_bytes_per_node']):>16} "
                     f"{_gb(e.get('grad_buffer_host_bytes_per_node', 0.0)):>17} "
                     f"{_gb(e['cache_device_bytes_per_rank']):>18}{'' if e['device_fits'] else '  (exceeds headroom)'}")
    lines.append("\nfcdp: node cache, DeepSpeed's gradient path; fcdp_node: plus grad_reduce hierarchical and "
                 "grad_accumulation node; bound: changed parameters in once, gradient out once per node and step")
    if result["cached_fraction"] < 1.0:
        lines.append(f"\nhost RAM holds {result['cached_fraction']:.0%} of the cache; the rest runs as plain ZeRO-3.")
    lines += ["", "recommended block:", json.dumps({"fcdp": result["recommended_fcdp_block"]})]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="fcdp plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=parse_count, required=True, help="total parameters, e.g. 30B")
    ap.add_argument("--config", help="DeepSpeed config (JSON/HJSON): dtype and gradient accumulation are read from it")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--ranks-per-node", type=int, required=True)
    ap.add_argument("--inter-gbps", type=float, default=10.0)
    ap.add_argument("--intra-gbps", type=float, default=1200.0)
    ap.add_argument("--pcie-gbps", type=float, default=200.0)
    ap.add_argument("--host-ram-gb", type=float, default=1024.0)
    ap.add_argument("--device-mem-gb", type=float, default=80.0)
    ap.add_argument("--device-used-gb", type=float, default=None)
    ap.add_argument("--trainable-fraction", type=float, default=1.0)
    ap.add_argument("--no-backward-fraction", type=float, default=0.0)
    ap.add_argument("--grad-accum", type=int, default=None)
    ap.add_argument("--dtype-bytes", type=int, default=None)
    ap.add_argument("--regime", choices=["large", "default"], default="large")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    ap.add_argument("--compute-s", type=float, default=0.0)
    ap.add_argument("--param-gather", choices=["flat", "hierarchical", "auto"], default="auto",
                    help="fcdp.param_gather of the FCDP engines (how cache misses are gathered)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    ga, dtype_bytes = args.grad_accum, args.dtype_bytes
    if args.config:
        from fcdp_deepspeed.config import load_ds_config
        cfg = load_ds_config(args.config)
        if ga is None and isinstance(cfg.get("gradient_accumulation_steps"), int):
            ga = cfg["gradient_accumulation_steps"]
        if dtype_bytes is None:
            half = (cfg.get("bf16") or {}).get("enabled") or (cfg.get("fp16") or {}).get("enabled")
            dtype_bytes = 2 if half else 4
    spec = ClusterSpec(params=args.params, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                       trainable_fraction=args.trainable_fraction, grad_accum=ga or 1, dtype_bytes=dtype_bytes or 2,
                       inter_gbps=args.inter_gbps, intra_gbps=args.intra_gbps, pcie_gbps=args.pcie_gbps,
                       host_ram_gb=args.host_ram_gb, device_mem_gb=args.device_mem_gb, device_used_gb=args.device_used_gb,
                       no_backward_fraction=args.no_backward_fraction, regime=args.regime, backend=args.backend,
                       compute_s=args.compute_s, param_gather=args.param_gather)
    result = plan(spec)
    print(json.dumps(result, indent=1) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
