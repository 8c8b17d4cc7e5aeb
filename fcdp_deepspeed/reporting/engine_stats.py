"""One engine's counters as a dict: what ``get_stats`` and the integrations' log entries report."""
from __future__ import annotations

from typing import Any

from fcdp_deepspeed.machine import comm_warmup
from fcdp_deepspeed.reporting.stats import LEDGER


def _process_totals() -> dict:
    totals = {**LEDGER.totals.allgather_summary(), **LEDGER.totals.snapshot()}
    return {f"process_{k}": v for k, v in totals.items()}


def stats_of(optimizer: Any) -> dict:
    """:func:`get_stats` given the engine's ``optimizer`` (the ZeRO-3 optimizer or offload object)."""
    runtime = getattr(optimizer, "fcdp", None)
    if runtime is not None:
        out = runtime.stats()
    else:
        # Engines built by FCDP's classes count their own collectives (fcdp_comm); others, built before
        # install(), only have the process's counts since counting began.
        comm = getattr(optimizer, "fcdp_comm", None)
        since = comm.copy() if comm is not None else LEDGER.totals.copy()
        out = {
            **since.allgather_summary(),
            "cache_hits": 0, "cache_misses": 0, "host_cache_bytes": 0, "device_cache_bytes": 0,
            "fcdp_enabled": False,
            **since.snapshot(),
        }
    paths = getattr(optimizer, "fcdp_paths", None)
    if paths is not None:  # fcdp.link's choice; on ZeRO-3's paths the engine is the counted plain one
        out.update(paths.stats(), fcdp_enabled=True)
        if runtime is None:  # the probe created the node and node-peer communicators: what they took
            out.update(comm_warmup_bytes=dict(comm_warmup.MEASURED))
    plan = getattr(optimizer, "fcdp_grad_plan", None)
    if plan is not None:  # the resolved gradient modes (auto resolved), with or without a reducer
        out.update(plan.stats())
    reducer = getattr(optimizer, "fcdp_grads", None)
    if reducer is not None:
        out.update(reducer.stats())
        if "grad_compressed_inter_node_bytes" in out:  # grad_compression: what of the inter-node stage crossed exact
            out["grad_exact_inter_node_bytes"] = out["inter_node_grad_reduce_bytes"] - out["grad_compressed_inter_node_bytes"]
    diloco = getattr(optimizer, "fcdp_diloco", None)
    if diloco is not None:  # fcdp.diloco: the outer syncs (docs/diloco.md)
        out.update(diloco.stats(), fcdp_enabled=True)
    stack = getattr(optimizer, "fcdp_layered", None)
    if stack is not None:  # fcdp.layered: the chunks and what ran layered (layered/stack.py)
        out.update(stack.stats())
    out.setdefault("fcdp_enabled", True)
    clock = getattr(optimizer, "fcdp_clock", None)
    if clock is not None:  # plain engines too: their gradient buckets and step (timeline.py)
        out.update(clock.stats())
    out["engine_counted"] = hasattr(optimizer, "fcdp_comm")
    comm = getattr(optimizer, "fcdp_comm", None)
    out["node_layout_source"] = LEDGER.layout_for(comm)[1] if comm is not None else LEDGER.layout_source
    out.update(_process_totals())
    return out
