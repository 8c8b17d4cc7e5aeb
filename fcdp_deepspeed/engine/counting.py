"""A plain ZeRO-3 engine's traffic, counted like an FCDP engine's.

Engines built after :func:`~fcdp_deepspeed.install` without an enabled block still get their own
:class:`~fcdp_deepspeed.reporting.stats.CommCounters`: their parameters' gathers and their optimizer's
reduction and step attribute to it exactly as an FCDP engine's do, so ``get_stats`` of a ZeRO-3
run and of an FCDP run (or of a policy and a reference engine in one process) compare like for
like. No collective is added to the engine's creation: the node layout is guessed (see
:func:`~fcdp_deepspeed.machine.topology.guess_node_map`) unless one was discovered already.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.machine.topology import guess_node_map
from fcdp_deepspeed.reporting.stats import LEDGER, CommCounters, LayoutKind
from fcdp_deepspeed.runtime.fetch import count_gathers


def count_plain_engine(module: torch.nn.Module, comm: CommCounters, ranks_per_node: Optional[int]) -> None:
    """Start counting collectives by link class (if nothing did yet) and attribute ``module``'s gathers to ``comm``."""
    node_of_rank, source = guess_node_map(os.environ, dist.get_world_size(), ranks_per_node)
    LEDGER.install(node_of_rank, source, kind=LayoutKind.GUESS)
    comm.node_of_rank, comm.layout_source, comm.follows_process = node_of_rank, source, True
    for param in module.parameters():
        if hasattr(param, "ds_id"):
            count_gathers(param, comm)
