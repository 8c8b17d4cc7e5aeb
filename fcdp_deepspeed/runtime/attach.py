"""Attaching the node cache to an engine: which parameters are cached, and DeepSpeed pointed at them.

[Note: how the cache plugs into DeepSpeed]
DeepSpeed 0.19.8's ZeRO++ hpZ path already gathers a parameter over a small group from a
per-rank "secondary" slice whenever ``param.ds_secondary_tensor`` is set (coordinator split, group
switch in ``all_gather_coalesced``, slice reassembly in ``AllGatherCoalescedHandle.wait``). FCDP
reuses that tested gather path and owns everything around it:

- the group: node ∩ DP group from the real topology (hpZ uses contiguous rank blocks);
- the storage: pooled host (or budgeted device) slots, filled on release (``_SecondaryHook``
  replaces ``Init._partition_param_sec`` on each ``zero.Init`` instance that partitioned the model,
  so no DeepSpeed-allocated device secondary is ever created);
- validity: entries are invalidated on every event that can change a value (see ``stage3.py``),
  including the ones hpZ misses (frozen params on checkpoint load, requires_grad flips).

The ``zero.Init`` instances are configured *after* the model and optimizer are built (retrofit), so
models built under ``zero.Init(config_dict_or_path=...)``, under a bare ``zero.Init()``, or handed
unpartitioned to ``deepspeed.initialize`` are all cached the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import Init
from deepspeed.utils import logger

from fcdp_deepspeed.config import FCDPConfig, FCDPConfigError
from fcdp_deepspeed.machine.topology import Topology, TopologyError, build_topology, group_ranks
from fcdp_deepspeed.reporting.stats import LEDGER, CacheCounters, LayoutKind
from fcdp_deepspeed.runtime.fetch import unwrapped
from fcdp_deepspeed.storage.cache import CacheEntry, NodeCache


#: ``Attachment.uncached`` reason of every parameter when the DP group lies on one node.
ONE_NODE = "one node (nothing to save across nodes)"
#: ``Attachment.uncached`` reason of a parameter an earlier FCDP engine over the same model caches.
#:
#: [Note: two engines over one model] An evaluation engine built before the training engine, a reference model
#: sharing modules with a policy, a re-initialization after a failed start: a parameter has one
#: ``ds_secondary_tensor`` and one set of gather entry points, so the first engine that cached it keeps serving it,
#: for every engine over the model; a later engine gives it no slot of its own (no second copy of the model in host
#: memory). Every engine's writes stamp the parameter ([Note: freshness by construction] in ``storage/freshness.py``),
#: so the first engine's slot is checked against the other engine's optimizer steps and loads at every read.
SHARED = "cached by an earlier FCDP engine over the same model (its cache serves this engine too)"


@dataclass(eq=False)
class Attachment:
    """What attaching one engine produced; fixed for the engine's life."""

    topology: Topology
    #: One entry per cached parameter (its state is the cache's to change, see ``cache.py``).
    cache: NodeCache
    #: Parameters that never got an entry: reason -> count.
    uncached: dict[str, int] = field(default_factory=dict)
    #: The partition hooks of the ``zero.Init`` instances that partitioned the parameters.
    hooks: list = field(default_factory=list)


def init_owner(param: torch.nn.Parameter) -> Init:
    """The ``zero.Init`` instance that converted ``param``.

    Its per-param closures (``param.all_gather``) capture it as ``self``; we read it from there so
    models partitioned before :func:`fcdp_deepspeed.install` ran are found too.
    """
    fn = unwrapped(param.all_gather)
    code, cells = fn.__code__, fn.__closure__ or ()
    if "self" in code.co_freevars:
        owner = cells[code.co_freevars.index("self")].cell_contents
        if isinstance(owner, Init):
            return owner
    raise TypeError(f"cannot find the zero.Init instance that partitioned parameter ds_id={param.ds_id}")


class _SecondaryHook:
    """Stands in for ``Init._partition_param_sec`` on one ``zero.Init`` instance.

    DeepSpeed calls it from ``Init._partition`` for every partition of every param of that instance
    (release after use, ``partition(has_been_updated=True)`` after an in-place update). Params that
    belong to no FCDP cache are left alone: hpZ would otherwise allocate a device secondary for them.
    """

    def __init__(self, node_ranks: tuple[int, ...]) -> None:
        self.node_ranks = node_ranks
        self.caches: list[NodeCache] = []
        #: Called with ``(param, has_been_updated)`` for every partition, cached or not (the reference store).
        self.listeners: list[Callable[[torch.nn.Parameter, bool], None]] = []

    def __call__(self, param: torch.nn.Parameter, buffer: Any = None, has_been_updated: bool = False) -> None:
        for listener in self.listeners:
            listener(param, has_been_updated)
        for cache in self.caches:
            entry = cache.entry(param)
            if entry is not None:
                cache.on_partition(entry, has_been_updated)
                return


def attach(config: FCDPConfig, params: list[torch.nn.Parameter], dp_group: Any, param_names: Mapping,
           counters: CacheCounters) -> Attachment:
    """Collective over ``dp_group``: build the node layout, one cache entry per cacheable parameter,
    and retrofit the ``zero.Init`` instances that partitioned them (slots are allocated later)."""
    topo = build_topology(dp_group, config.ranks_per_node)
    LEDGER.install(topo.node_of_rank, topo.source,
                   kind=LayoutKind.ENGINE_SETTING if config.ranks_per_node is not None else LayoutKind.DISCOVERED)
    attached = Attachment(topo, NodeCache(topo.rank_in_node, counters, checksums=config.verify_rate > 0))
    if topo.num_nodes == 1:
        # [Note: one node] The cache saves inter-node bytes only; on one node it would hold model/L per
        # rank and refill every step for nothing. So no entry, no slot, no hpZ retrofit: DeepSpeed's own
        # path, bit for bit, with the gathers still counted (fetch wrappers). grads.build_reducer
        # likewise builds no gradient buffer; this is the one log line for both.
        attached.uncached[ONE_NODE] = len(params)
        if dist.get_rank() == 0:
            logger.warning(f"fcdp: all {topo.dp_size} data-parallel ranks are on one node: there is no inter-node "
                           f"traffic to save, so FCDP takes no memory (no cache slots, no gradient buffer) and the "
                           f"job runs as plain ZeRO-3 with FCDP's counters reporting. Set fcdp.ranks_per_node to "
                           f"simulate several nodes.")
        return attached
    hooks = {}
    for param in _select_candidates(params, topo, config.min_numel, attached.uncached):
        owner = init_owner(param)
        if id(owner) not in hooks:
            hooks[id(owner)] = _retrofit(owner, topo)
        if any(cache.entry(param) is not None for cache in hooks[id(owner)].caches):
            # [Note: two engines over one model] the earlier engine's slot and fetch path serve this one too
            attached.uncached[SHARED] = attached.uncached.get(SHARED, 0) + 1
            continue
        slot_numel = owner._aligned_size(param) // topo.ranks_per_node
        entry = CacheEntry(param=param, name=param_names.get(param, f"ds_id={param.ds_id}"), slot_numel=slot_numel,
                           start=slot_numel * topo.rank_in_node, dtype=param.ds_tensor.dtype)
        attached.cache.entries[param.ds_id] = entry
        param.ds_zero_param_process_group = topo.group
        param.ds_secondary_tensor_group_size = topo.ranks_per_node
        param.ds_secondary_tensor_num_of_groups = topo.dp_size // topo.ranks_per_node
    for hook in hooks.values():
        hook.caches.append(attached.cache)
    attached.hooks = list(hooks.values())
    return attached


def _select_candidates(params: list[torch.nn.Parameter], topo: Topology, min_numel: int,
                       uncached: dict[str, int]) -> list[torch.nn.Parameter]:
    """The parameters to cache, in ``ds_id`` order; counts the others in ``uncached`` by reason."""
    chosen = []
    group_cache: dict[int, tuple[int, ...]] = {}
    for param in params:
        gid = id(param.ds_process_group)
        if gid not in group_cache:
            group_cache[gid] = group_ranks(param.ds_process_group)
        reason = None
        if param.ds_persist:
            reason = "persistent (stage3_param_persistence_threshold)"
        elif param.ds_numel == 0 or param.ds_numel < min_numel:
            reason = "smaller than fcdp.min_numel" if param.ds_numel else "zero-size"
        elif group_cache[gid] != topo.dp_ranks:
            reason = "partitioned over a different process group than the engine's DP group"
        elif hasattr(param.ds_tensor, "ds_quant_scale"):
            reason = "quantized"
        if reason is None:
            chosen.append(param)
        else:
            uncached[reason] = uncached.get(reason, 0) + 1
    return sorted(chosen, key=lambda p: p.ds_id)


def _retrofit(owner: Init, topo: Topology) -> _SecondaryHook:
    """Point one ``zero.Init`` instance's hpZ machinery at the node group and our storage."""
    hook = owner.__dict__.get("_partition_param_sec")
    if isinstance(hook, _SecondaryHook):
        if hook.node_ranks != topo.node_ranks:
            raise TopologyError(f"this model is already cached by an FCDP engine with node group {hook.node_ranks}, "
                                f"not {topo.node_ranks}; one zero.Init model cannot serve two layouts.")
        return hook
    if owner.zero_param_process_group is not None:
        raise FCDPConfigError("the model was partitioned by a zero.Init with a ZeRO++ hpZ group "
                              "(zero_hpz_partition_size > 1). Fix: remove zero_hpz_partition_size from the config "
                              "passed to zero.Init; fcdp builds its own node group.")
    if owner.dp_world_size != topo.dp_size:
        raise TopologyError(f"the model was partitioned over {owner.dp_world_size} ranks but the engine's data-parallel "
                            f"group has {topo.dp_size}. Fix: pass the same data_parallel_group/mpu to zero.Init and "
                            f"deepspeed.initialize.")
    owner.zero_param_process_group = topo.group
    owner.num_ranks_in_param_group = topo.ranks_per_node
    owner.rank_in_group = topo.rank_in_node
    owner.num_param_groups = topo.dp_size // topo.ranks_per_node
    hook = _SecondaryHook(topo.node_ranks)
    owner._partition_param_sec = hook
    return hook
