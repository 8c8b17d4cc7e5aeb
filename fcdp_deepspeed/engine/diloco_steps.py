"""``FCDPStage3``'s DiLoCo part (a mixin of helpers; the DeepSpeed overrides that call them are ``FCDPStage3``'s, in
``stage3.py``): the node layout before DeepSpeed builds the optimizer, the re-partition after its parameter offload,
the warm-up's gradient average before each step and the sync after it.

Under DiLoCo the FCDP cache and gradient modes are not built: across nodes nothing is gathered or reduced
between syncs, so there is nothing for them to save (``fcdp.diloco`` refuses their explicit settings).
"""
from __future__ import annotations

from typing import Any, Optional

from deepspeed import comm as dist
from deepspeed.utils import logger

from fcdp_deepspeed.compress.quant import codec_for, ready
from fcdp_deepspeed.compress.state import CompressionState
from fcdp_deepspeed.diloco.exchange import PseudoGradExchange
from fcdp_deepspeed.diloco.layout import check_same_start, repartition_over_node, valid_ranges
from fcdp_deepspeed.diloco.outer import OuterState
from fcdp_deepspeed.diloco.state import DiLoCoState
from fcdp_deepspeed.diloco.sync import DiLoCoSync
from fcdp_deepspeed.diloco.warmup import average_over_peers_
from fcdp_deepspeed.engine import announce
from fcdp_deepspeed.machine.topology import Topology, TopologyError, build_topology
from fcdp_deepspeed.reporting.stats import LEDGER

#: The ledger tag of the sync's collectives (``inter_node_diloco_bytes`` in ``get_stats``).
DILOCO_FAMILY = "diloco"


def build_layout(dp_group: Any, ranks_per_node: Optional[int]) -> Topology:
    """Collective over the world: the node groups and node-peer groups; refuses a single node."""
    topo = build_topology(dp_group, ranks_per_node)
    if topo.num_nodes < 2:
        raise TopologyError(f"fcdp.diloco needs at least two nodes (one replica per node); this job runs on "
                            f"{topo.num_nodes} node of {topo.ranks_per_node} ranks (from {topo.source}). Fix: remove "
                            f"fcdp.diloco on one node, or launch on several nodes (fcdp.ranks_per_node simulates them).")
    return topo


class DiLoCoSteps:
    """DiLoCo's part of ``FCDPStage3`` (inert when ``fcdp_diloco_topology`` is ``None``); no DeepSpeed method is
    overridden here."""

    fcdp_diloco_topology: Optional[Topology] = None
    fcdp_diloco: Optional[DiLoCoSync] = None

    def _diloco_kwargs(self, fcdp_config: Any, kwargs: dict) -> dict:
        """Before DeepSpeed builds the optimizer: each node one replica, ZeRO-3 over the node (collective)."""
        if not (fcdp_config.enabled and fcdp_config.diloco is not None):
            return kwargs
        self.fcdp_diloco_topology = build_layout(kwargs.get("dp_process_group"), fcdp_config.ranks_per_node)
        return {**kwargs, "dp_process_group": self.fcdp_diloco_topology.group}

    def _diloco_repartition(self, module) -> None:
        """After DeepSpeed's parameter offload: the parameters re-partitioned over the node."""
        topo = self.fcdp_diloco_topology
        if topo is not None:
            moved = repartition_over_node(list(module.parameters()), topo.group)
            if dist.get_rank() == 0:
                logger.info(f"fcdp.diloco: {moved} parameters re-partitioned over the node ({topo.ranks_per_node} ranks)")

    def _peer_group(self) -> Any:
        topo = self.fcdp_diloco_topology
        return topo.peer_group if topo.peer_ranks else None  # one rank per node: the peers are the whole world

    def _attach_diloco(self, fcdp_config: Any) -> None:
        topo, cfg = self.fcdp_diloco_topology, fcdp_config.diloco
        peers = self._peer_group()
        masters = self.fp32_partitioned_groups_flat
        frozen = [p.ds_tensor for group in self.fp16_groups for p in group if not p.requires_grad]
        check_same_start([m.view(-1) for m in masters] + frozen, peers, "weights")
        codec = ready(codec_for(cfg.compression, fcdp_config.compression_block, side="grads"),
                      masters[0].device if masters else "cpu")
        node = topo.node_of_rank[dist.get_rank()]
        layout = {"node": sorted(set(topo.node_of_rank)).index(node), "nodes": topo.num_nodes,
                  "ranks_per_node": topo.ranks_per_node}
        ranges = [valid_ranges(group, topo.rank_in_node) for group in self.fp16_groups]
        self.fcdp_diloco = DiLoCoSync(cfg, PseudoGradExchange(codec, peers, topo.num_nodes, blocking=cfg.overlap == 0),
                                      topo.group, ranges,
                                      OuterState.from_masters(masters, codec is not None), layout)
        self.fcdp_state = CompressionState()
        self.fcdp_state.register("diloco", DiLoCoState(self.fcdp_diloco, lambda: self.fp32_partitioned_groups_flat,
                                                       peers))
        announce.announce_diloco(topo, cfg, self.fcdp_diloco.outer.nbytes)

    def _diloco_before_step(self) -> None:
        """A warm-up step's gradient partitions averaged over the nodes ([Note: the warm-up] in diloco/warmup.py)."""
        sync = self.fcdp_diloco
        if sync is not None and sync.in_warmup:
            with self._attributed(), LEDGER.tagged(DILOCO_FAMILY):
                # stage 3's reduced gradient partitions, as its step reads them (offload_optimizer is refused)
                sync.warmup_bytes += average_over_peers_([self.grad_partitions_flat_buffer], self._peer_group(),
                                                         self.fcdp_diloco_topology.num_nodes)

    def _diloco_after_step(self) -> None:
        """The step counted; the fragment due completed (the outer step), the next one issued."""
        if self.fcdp_diloco is not None:
            with self._attributed(), LEDGER.tagged(DILOCO_FAMILY):
                self.fcdp_diloco.after_step(self)
