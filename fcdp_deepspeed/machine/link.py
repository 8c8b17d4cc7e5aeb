"""The link probe: which paths an engine runs (``fcdp.link``), decided once at build, the same on every rank.

The rule is :func:`fcdp_deepspeed.paths.choose` ([Note: why a choice at all] there); this module supplies its
input, one fetch timed each way on the engine's own groups, and agrees on it ([Note: one choice per job] at
:func:`choose_for`): the times differ between ranks (each rank's clock, its share of the link), so every rank takes
the largest time of each kind over the data-parallel group (one all-reduce) and decides from the same numbers.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Optional

import torch

from deepspeed import comm as dist

from fcdp_deepspeed import paths
from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.machine import comm_warmup, device
from fcdp_deepspeed.machine.topology import Topology, build_topology

#: Timed rounds after one untimed; the fastest of each kind counts ([Note: a probe that holds still]).
REPEATS = 5


def fetch_bytes(module: torch.nn.Module) -> int:
    """Mean full bytes of the parameters one module owns directly (a fetch's size), over modules that own any."""
    sizes = []
    for sub in module.modules():
        own = [p for p in sub.parameters(recurse=False) if hasattr(p, "ds_numel")]
        if own:
            sizes.append(sum(p.ds_numel * p.ds_tensor.element_size() for p in own))
    return int(sum(sizes) / len(sizes)) if sizes else 0


def choose_for(config: FCDPConfig, dp_group: Any, module: torch.nn.Module) -> tuple[paths.PathChoice, Topology]:
    """Collective over the world (the layout, the job's vote) and over ``dp_group`` (the probe): the paths one engine
    over ``module`` runs, and its layout.

    [Note: one choice per job] A rank that ran other paths than the rest would issue other collectives (FCDP's
    engine adds collectives over the world: the layout, a barrier at each checkpoint) and hang the job. Inside one
    data-parallel group every rank decides from the same agreed times (:func:`agree`); across the groups of a job
    (tensor or pipeline parallelism: one group may lie on one node while another spans nodes) a world all-reduce
    makes the job's choice: FCDP's paths wherever one group's probe asks for them, ZeRO-3's where every probe kept
    them. The first probe of a layout decides for the process: a later engine (an evaluation engine, a reference
    model over the same parameters) follows it, as it shares the first engine's gathers ([Note: two engines over one
    model] in ``runtime/attach.py``)."""
    topo = build_topology(dp_group, config.ranks_per_node)
    spans = topo.num_nodes > 1 and bool(topo.peer_ranks)  # two paths to weigh
    if config.paths_asked():
        return paths.PathChoice(paths.Paths.FCDP, "the block sets a path key"), topo
    if config.link != "probe":
        return (paths.declared(config.link) if spans else _nothing_to_weigh(topo)), topo
    key = (config.ranks_per_node, topo.dp_groups, tuple(topo.node_of_rank))
    if key not in _CHOSEN:
        local = choose_paths(config, topo, dp_group, fetch_bytes(module)) if spans else None
        _CHOSEN[key] = vote(local, topo)
    return _CHOSEN[key], topo


#: The job's choice by layout, in this process ([Note: one choice per job]).
_CHOSEN: dict[tuple, paths.PathChoice] = {}
_VOTES = {None: 0, paths.Paths.ZERO3: 1, paths.Paths.FCDP: 2}


def vote(local: Optional[paths.PathChoice], topo: Topology) -> paths.PathChoice:
    """Collective over the world: this rank's group's choice (``None``: nothing to weigh) made the job's."""
    votes = device.small_to_accel([_VOTES[local.paths if local is not None else None]], torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    job = device.small_to_host(votes)[0]
    if job == _VOTES[paths.Paths.FCDP]:
        if local is not None and local.paths is paths.Paths.FCDP:
            return local
        if local is None:
            return _nothing_to_weigh(topo)
        return paths.PathChoice(paths.Paths.FCDP, f"another data-parallel group of the job needs FCDP's paths (this "
                                                  f"group's probe: {local.why})", local.times)
    if job == _VOTES[paths.Paths.ZERO3]:
        return local if local is not None else paths.PathChoice(
            paths.Paths.ZERO3, "every data-parallel group of the job that spans nodes keeps ZeRO-3's paths")
    return _nothing_to_weigh(topo)


def _nothing_to_weigh(topo: Topology) -> paths.PathChoice:
    why = "one node" if topo.num_nodes == 1 else "one rank per node (no two-stage path to weigh)"
    return paths.PathChoice(paths.Paths.FCDP, why)


def choose_paths(config: FCDPConfig, topo: Topology, dp_group: Any, nbytes: int) -> paths.PathChoice:
    """Collective over ``dp_group``: the paths this group's probe chooses."""
    return paths.choose(agree(time_locally(topo, dp_group, max(nbytes, 4 * topo.dp_size)), dp_group))


def time_locally(topo: Topology, dp_group: Any, nbytes: int) -> paths.FetchTimes:
    """This rank's times of one fetch of ``nbytes`` each way, fitted from two timed sizes (at most
    :data:`~fcdp_deepspeed.paths.PROBE_MAX_BYTES`). Collective over the DP, node and node-peer groups.

    [Note: a probe that holds still] One collective of a megabyte takes a few milliseconds on a fast link, where the
    scheduler's noise is of the same order. So every round times each kind at each size back to back, interleaved
    (a slow moment slows all of them alike), the two stages of a miss as one unit (as a miss runs them), and the
    fastest of :data:`REPEATS` rounds counts."""
    comm_warmup.warm_up({"node": topo.group, "node_peers": topo.peer_group})  # before any use ([Note: why warm up])
    world, per_node, nodes = topo.dp_size, topo.ranks_per_node, topo.num_nodes
    large = max(world, min(nbytes, paths.PROBE_MAX_BYTES) // world * world)
    small = max(world, large // 16 // world * world)
    runs = {}
    for size in (small, large):
        shard = size // world
        full = device.accel_empty(size, torch.uint8)
        mine, bundle, node_in = full.narrow(0, 0, shard), full.narrow(0, 0, shard * nodes), full.narrow(0, 0, size // per_node)
        flat = functools.partial(dist.allgather_fn, full, mine, group=dp_group)
        stage1 = functools.partial(dist.allgather_fn, bundle, mine, group=topo.peer_group)
        node = functools.partial(dist.allgather_fn, full, node_in, group=topo.group)
        runs.update({("flat", size): (flat,), ("two_stage", size): (stage1, node), ("node", size): (node,)})
    best = {key: float("inf") for key in runs}
    for attempt in range(REPEATS + 1):
        for key, collectives in runs.items():
            dist.barrier(group=dp_group)
            start = time.perf_counter()
            for collective in collectives:
                collective()
            device.host_wait(device.record_event())
            if attempt:  # the first round is untimed (buffers, connections)
                best[key] = min(best[key], time.perf_counter() - start)
    at = {kind: paths.fit((small, best[(kind, small)]), (large, best[(kind, large)]), nbytes)
          for kind in ("flat", "two_stage", "node")}
    return paths.FetchTimes(nbytes, at["flat"], at["two_stage"], at["node"])


def agree(times: paths.FetchTimes, dp_group: Any) -> paths.FetchTimes:
    """Every rank's times replaced by the largest of each kind over the DP group ([Note: one choice per job])."""
    values = device.small_to_accel([times.flat_s, times.two_stage_s, times.node_s], torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=dp_group)
    flat, two_stage, node = device.small_to_host(values)
    return paths.FetchTimes(times.nbytes, flat, two_stage, node, times.source)
