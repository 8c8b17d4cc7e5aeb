"""``fcdp plan`` for a config with ``fcdp.diloco``: per-rank memory (ZeRO-3 over the node) and the sync's bytes.

Memory per rank, ZeRO-3 over the node's L ranks (not the world's W): 16-bit parameters and gradients
(``dtype_bytes`` each), fp32 master weights and Adam's two moments (12 B) per trainable parameter, all / L; host
memory: the outer shard and momentum (8 B per trainable parameter / L), plus the residual (4 B) with compression.
Inter-node bytes per optimizer step: each rank's pseudo-gradient message reaches its N - 1 peers (an all-gather;
uncompressed and blocking on N > 2 nodes two stages of 2 (N - 1) / N of a message), once every ``sync_every`` steps; during ``warmup_steps`` each rank's gradient partition (the model's dtype, as
stage 3 accumulates it unless ``data_types.grad_accum_dtype`` says otherwise) is averaged with its N - 1 peers every
step: one partition per rank on 2 nodes, 2 (N - 1) / N of one in two stages on more (``diloco/warmup.py``).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from fcdp_deepspeed.tools.plan.compression import wire_bytes

GIB = 2**30


def diloco_plan(spec: Any, block: Mapping[str, Any]) -> dict:
    """The DiLoCo rows for ``spec`` (a ``planner.ClusterSpec``) and the config's ``fcdp.diloco`` ``block``."""
    n, L, h = spec.nodes, spec.ranks_per_node, int(block.get("sync_every", 50))
    codec = block.get("compression", "off")
    p, t = spec.params, spec.params * spec.trainable_fraction
    device = lambda ranks: (2 * spec.dtype_bytes * p + 12 * t) / ranks  # noqa: E731 - params+grads, master+Adam
    message = wire_bytes(codec, int(t / L), spec.compression_block)
    # summed over all node uplinks: N - 1 messages per rank, or 2 (N - 1) / N of one in two stages (diloco/exchange.py)
    overlap = block.get("overlap_steps")  # as DiLoCoConfig.overlap resolves it
    blocking = int(overlap) == 0 if overlap is not None else int(block.get("fragments", 1)) == 1
    two_stage = codec == "off" and n > 2 and blocking
    per_sync = n * L * (2 * (n - 1) / n if two_stage else n - 1) * message
    warmup = int(block.get("warmup_steps", 0))
    return {"sync_every": h, "compression": codec, "warmup_steps": warmup,
            # 2 (N - 1) / N of a partition per rank ([Note: the warm-up in two stages] in diloco/warmup.py)
            "inter_node_bytes_per_warmup_step": n * L * 2 * (n - 1) / n * spec.dtype_bytes * t / L,
            "device_bytes_per_rank": device(L), "device_bytes_per_rank_exact_zero3": device(n * L),
            "outer_host_bytes_per_rank": (12 if codec != "off" else 8) * t / L,
            "inter_node_bytes_per_sync": per_sync, "inter_node_bytes_per_step": per_sync / h}


def format_diloco(rows: Optional[dict], exact_step_bytes: float) -> list[str]:
    if not rows:
        return []
    return ["", f"DiLoCo (LOSSY, fcdp.diloco): H = {rows['sync_every']}, pseudo-gradients {rows['compression']}; "
            f"ZeRO-3 over each node: {rows['device_bytes_per_rank'] / GIB:.2f} GiB per rank of parameters, gradients "
            f"and optimizer states (exact ZeRO-3 over the world: {rows['device_bytes_per_rank_exact_zero3'] / GIB:.2f}); "
            f"outer state {rows['outer_host_bytes_per_rank'] / GIB:.2f} GiB host memory per rank; inter-node "
            f"{rows['inter_node_bytes_per_step'] / GIB:.4f} GiB per step over all uplinks "
            f"({rows['inter_node_bytes_per_step'] / (exact_step_bytes or 1.0):.4f}x the bound)"
            + _warmup(rows, exact_step_bytes)]


def _warmup(rows: dict, exact_step_bytes: float) -> str:
    if not rows["warmup_steps"]:
        return ""
    step = rows["inter_node_bytes_per_warmup_step"]
    return (f"; first {rows['warmup_steps']} exact warm-up steps at {step / GIB:.4f} GiB per step "
            f"({step / (exact_step_bytes or 1.0):.4f}x the bound)")
