"""``fcdp.param_compression`` in one engine's runtime: which parameters get a reference slot, where it lives
(the cache's budget rules), and the one log line where compression cannot apply.

[Note: which parameters are compressed]
A parameter's stage 1 is compressed when it has a reference slot and a valid reference. Slots go to the
parameters the optimizer owns and that require grad at engine build (frozen ones never change, and are
served by the cache), that the two-stage gather serves (partitioned over the engine's DP group, not
persistent, not quantized) and whose partition is smaller compressed than exact (``compressed_gather.pays``:
a partition of a few elements costs a whole block and its scale). Slots are N*p elements of the
parameter's dtype, placed like cache slots, after them: pinned host memory within what the cache left of
``host_budget`` (``cache_device: device``: accelerator memory within what it left of ``device_budget``
first), agreed across ranks; a parameter whose slot does not fit on some rank crosses exactly on every
rank (one warning).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from deepspeed import comm as dist
from deepspeed.utils import logger

from fcdp_deepspeed.compress.quant import codec_for, ready
from fcdp_deepspeed.config import FCDPConfig, FCDPConfigError, resolved_param_compression
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.machine.topology import Topology
from fcdp_deepspeed.reporting.stats import fmt_bytes
from fcdp_deepspeed.runtime.allocation import Allocation, fit_prefix
from fcdp_deepspeed.runtime.compressed_gather import DTYPES, DriftMeter, ParamCompression, pays
from fcdp_deepspeed.runtime.compression_reference import (CompressionCounters, Reference, ReferenceCheckpoint,
                                                          ReferenceStore)
from fcdp_deepspeed.runtime.gather import HierarchicalGather
from fcdp_deepspeed.storage.cache import NodeCache, Placement, SlotPool
from fcdp_deepspeed.storage.placement import SlotRequest, plan_placement


#: ``HierarchicalGather.unsupported`` reasons that hold for the whole run (such parameters never take stage 1).
_FLAT_FOREVER = ("quantized weights", "partitioned over another process group", "autocast communication dtype")


def _candidates(params: Iterable[torch.nn.Parameter], optimizer_ids: frozenset, gather: HierarchicalGather,
                setting: str, names: dict) -> list[torch.nn.Parameter]:
    out = [p for p in params if p.ds_id in optimizer_ids and p.requires_grad and not p.ds_persist and p.ds_numel > 0
           and gather.unsupported([p], quantize=False) not in _FLAT_FOREVER]
    refused = [p for p in out if p.ds_tensor.dtype not in DTYPES]
    if refused:
        p = refused[0]
        raise FCDPConfigError(f"fcdp.param_compression = \"{setting}\" reconstructs fp32, bf16 and fp16 parameters; "
                              f"{len(refused)} trainable parameter(s) are not (e.g. {names.get(p, f'ds_id={p.ds_id}')}: "
                              f"{p.ds_tensor.dtype}). Fix: set fcdp.param_compression to \"off\".")
    return sorted(out, key=lambda p: p.ds_id)


def build_compression(config: FCDPConfig, topo: Topology, gather: Optional[HierarchicalGather], cache: NodeCache,
                      allocation: Allocation, optimizer_ids: frozenset, params: list, names: dict
                      ) -> tuple[Optional[ParamCompression], Optional[ReferenceCheckpoint]]:
    """Collective over the DP group (slot agreement): the engine's compressed stage 1 and its checkpoint part,
    ``(None, None)`` when compression is off or cannot apply (one log line, rank 0)."""
    setting = resolved_param_compression(config, topo.num_nodes, topo.ranks_per_node)
    if config.param_compression != "off" and (setting == "off" or gather is None):
        if dist.get_rank() == 0:
            logger.warning(f"fcdp: param_compression = {config.param_compression!r} has no effect: the two-stage gather "
                           f"does not run ({topo.num_nodes} node(s) x {topo.ranks_per_node} rank(s) per node), so every "
                           f"parameter crosses exactly.")
        return None, None
    if setting == "off":
        return None, None
    codec = ready(codec_for(setting, config.compression_block), device.accel_device())
    counters = CompressionCounters()
    store = ReferenceStore(counters, config.param_refresh_interval)
    for p in _candidates(params, optimizer_ids, gather, setting, names):
        if pays(codec, p.ds_tensor.ds_numel, p.ds_tensor.dtype):
            store.refs[p.ds_id] = Reference(p, names.get(p, f"ds_id={p.ds_id}"), p.ds_tensor.ds_numel, topo.num_nodes,
                                            p.ds_tensor.dtype)
    _place(store, config, allocation, cache)
    me = dist.get_rank()
    key = {"codec": codec.name, "block": codec.block, "dp_ranks": list(gather.dp_ranks),
           "peer_ranks": list(gather.layout.peer_ranks), "node_ranks": list(gather.layout.node_ranks)}
    compression = ParamCompression(codec, store, counters, nodes=topo.num_nodes,
                                   peer_index=gather.layout.peer_ranks.index(me), dp_index=gather.dp_ranks.index(me),
                                   drift=DriftMeter())
    return compression, ReferenceCheckpoint(store, key, allocation.agree, gather.peer_group,
                                            gather.layout.peer_ranks.index(me))


def _place(store: ReferenceStore, config: FCDPConfig, allocation: Allocation, cache: NodeCache) -> None:
    """Collective: reserve the reference slots within what the cache left of the budgets, agreed across ranks."""
    refs = [store.refs[i] for i in sorted(store.refs)]
    host_pool, device_pool = cache.pools[Placement.HOST], cache.pools[Placement.DEVICE]
    host_left = max(0, allocation.host_budget - (host_pool.nbytes if host_pool else 0))
    device_left = 0
    if config.cache_device == "device":
        device_left = max(0, allocation.device_budget - (device_pool.nbytes if device_pool else 0))
    mode = "device" if config.cache_device == "device" else "host"
    plan = plan_placement([SlotRequest(r.param.ds_id, r.nbytes, frozen=False) for r in refs], mode, host_left, device_left)
    on_host = [r for r in refs if plan[r.param.ds_id] is Placement.HOST]
    for r in on_host[fit_prefix(SlotPool(Placement.HOST, pin=config.pin_memory).cost, on_host, host_left):]:
        plan[r.param.ds_id] = None  # chunking and pinned rounding past the budget
    planned = allocation.agree([plan[r.param.ds_id] is not None for r in refs])
    failed: list[Any] = []
    for placement in Placement:
        wanted = [r for r, ok in zip(refs, planned) if ok and plan[r.param.ds_id] is placement]
        if wanted:
            pool = SlotPool(placement, pin=config.pin_memory)
            failed += pool.reserve(wanted)
            store.pools[placement] = pool
    kept = allocation.agree([ok and r not in failed for r, ok in zip(refs, planned)])
    left_out = [r for r, ok in zip(refs, kept) if not ok]
    for r in left_out:
        del store.refs[r.param.ds_id]
        r.slot = None
    for pool in store.pools.values():
        pool.release_unused(store.refs.values())
    if left_out and dist.get_rank() == 0:
        logger.warning(f"fcdp: param_compression: {len(left_out)} trainable parameter(s) "
                       f"({fmt_bytes(sum(r.nbytes for r in left_out))} of references per rank) get no reference: they do "
                       f"not fit what the cache left of the budget (host {fmt_bytes(host_left)} per rank"
                       f"{f', device {fmt_bytes(device_left)}' if config.cache_device == 'device' else ''}) or the "
                       f"allocation failed on some rank, so they cross nodes exactly on every rank. Raise fcdp.host_budget"
                       f"{' or fcdp.device_budget' if config.cache_device == 'device' else ''} to compress them.")
