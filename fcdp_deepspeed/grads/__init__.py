"""The gradient path (``grad_reduce``/``grad_accumulation``): hierarchical reduce-scatter and node-local
gradient accumulation, in place of DeepSpeed's bucket reduce-scatter.

One concern per module: ``layout.py`` (where chunks travel, [Note: the two-stage reduction]),
``collectives.py`` (the two stages' collectives), ``buffer.py`` (the node buffer, its budget and
allocation, [Note: node accumulation]), ``delivery.py`` (which partitions DeepSpeed overwrites or adds to),
``reducer.py`` (the bucket and flush paths), ``inflight.py`` (the stages in flight), ``compressed.py`` (the
compressed inter-node stage, ``fcdp.grad_compression``) and ``residual.py`` (its error-feedback residuals),
``dispatch.py`` (the hook into DeepSpeed). This module builds an engine's reducer and exports the names the rest
of the package uses.

[Note: patch points] The names below are the submodules' own objects (classes, functions), so a patch of
``grads.GradReducer.reduce`` reaches every reducer. A module-level name is looked up where it is used:
:func:`build_reducer` (here) uses ``grads.build_layout``; :func:`~fcdp_deepspeed.grads.layout.pack_chunks`
uses ``grads.layout.order_index``.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.grads.buffer import BufferPlanner, NodeGradBuffer, fitting_prefix
from fcdp_deepspeed.grads.collectives import StageCollectives
from fcdp_deepspeed.grads.delivery import DeliveryLedger
from fcdp_deepspeed.grads.dispatch import bucket, install_dispatch, make_dispatch, uninstall_dispatch
from fcdp_deepspeed.grads.layout import (ReduceLayout, build_layout, chunk_numel, order_index, own_chunk_numel,
                                         pack_chunks)
from fcdp_deepspeed.grads.plan import BufferFit, GradPlan, resolve_grad_plan
from fcdp_deepspeed.grads.reducer import GradCounters, GradReducer
from fcdp_deepspeed.machine import comm_warmup
from fcdp_deepspeed.machine.topology import Topology

__all__ = ["BufferPlanner", "DeliveryLedger", "GradCounters", "GradReducer", "NodeGradBuffer", "ReduceLayout",
           "StageCollectives", "bucket", "build_layout", "build_reducer", "chunk_numel", "fitting_prefix",
           "install_dispatch", "make_dispatch", "order_index", "own_chunk_numel", "pack_chunks",
           "uninstall_dispatch"]


def build_reducer(config: FCDPConfig, topo: Topology, dp_group: Any, trainable: Sequence[torch.nn.Parameter],
                  accumulation_dtype: torch.dtype, is_boundary: Any, accumulation_steps: int = 2,
                  path_blockers: Sequence[str] = (), accumulation_blockers: Sequence[str] = (),
                  node_rss: Optional[int] = None) -> tuple[GradPlan, Optional[GradReducer]]:
    """Collective over the DP group (the buffer budget agreement, and the first use of the node and node-peer
    communicators if the runtime has not warmed them up; the topology created every group, [Note: groups from
    the global layout]): the engine's resolved gradient plan (logged once by rank 0), and its
    reducer, or ``None`` for DeepSpeed's own path (flat, or one node / one rank per node, where both
    stages would be one). With one micro-step per optimizer step every micro-step is a boundary, so the
    node buffer is only measured here; :meth:`GradReducer.plan_buffer` allocates it at the first
    micro-step that is not a boundary (``FCDPStage3._plan_buffer_if_window_grew``)."""
    def resolve(fit: Optional[BufferFit] = None, shape: Optional[tuple[int, int]] = None) -> GradPlan:
        nodes, per_node = shape or (topo.num_nodes, topo.ranks_per_node)
        return resolve_grad_plan(config.grad_reduce, config.grad_accumulation, nodes, per_node,
                                 accumulation_steps, path_blockers, accumulation_blockers, fit)

    for shape in topo.dp_shapes:  # an explicit mode refused for any DP group is refused on every rank
        resolve(shape=shape)  # (raises FCDPConfigError), not only on the ranks that would run it
    plan = resolve()
    reducer = None
    if plan.active:
        layout = build_layout(topo.dp_ranks, dict(enumerate(topo.node_of_rank)), dist.get_rank())
        assert layout.peer_ranks == topo.peer_ranks and layout.node_ranks == topo.node_ranks, (layout, topo)
        comm_warmup.warm_up({"node": topo.group, "node_peers": topo.peer_group})  # [Note: why warm up]
        reducer = GradReducer(config, layout, dp_group, topo.group, topo.peer_group, accumulation_dtype, is_boundary)
        reducer.planner.node_rss = node_rss
        if config.grad_accumulation != "rank" and not accumulation_blockers:
            plan = resolve(reducer.measure_buffer(trainable))
        reducer.node_accumulation = plan.grad_accumulation == "node"
        if accumulation_steps > 1:
            reducer.plan_buffer()
        install_dispatch()
    if dist.get_rank() == 0:
        from deepspeed.utils import logger
        (logger.warning if plan.fell_back else logger.info)(plan.log_line())
    return plan, reducer
