"""One coalesced fetch split into the collectives that serve it, in an order every rank agrees on.

[Note: one fetch, several collectives]
DeepSpeed's coordinator hands a module's partitioned parameters to ``all_gather_coalesced`` in the
iteration order of a set, which differs per rank (hashes are object addresses), split only into those
with and without an hpZ secondary. DeepSpeed's gather then takes the hpZ node-group path or the flat
ring from ``params[0]`` (``use_secondary_tensor``) before it sorts by ``ds_id``; 0.19.8 first splits by
group, in the order the groups appear in the list (0.18.9 gathers everything over the ``zero.Init``'s group).
The batched refill (``refill.py``) turns some of a call's misses into cache hits after the coordinator
split them, so a list handed to DeepSpeed whole could mix those hits with a miss the two-stage gather
does not serve (another process group, as MoE experts have, or an autocast communication dtype): a
rank whose list began with a hit gathered the miss's W-way partition over the node group of L ranks
(measured: a crash, "shape '[16]' is invalid for input of size 8"), one whose list began with the miss
ran the flat ring (mismatched collectives: a hang).

So every fetch is split here into parts that DeepSpeed (or the two-stage gather) routes one way each:
one route (:class:`Route`), one process group, one fallback reason, sorted by ``ds_id``. Parts are
issued by route (hits, two-stage, flat), then by their first ``ds_id``. Every input is the same on
every rank: hit or miss (agreed at planning, ``fetch.py``), a parameter's group and dtypes (built alike
on every rank), ``quantize`` (the coordinator's, from the config), so every rank issues the same
collectives in the same order. DeepSpeed's own split (group, then dtype) finds nothing left to split.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fcdp_deepspeed.runtime.gather import HierarchicalGather


class Route(enum.Enum):
    """How one part of a fetch is gathered (members in issue order)."""

    #: Cache hits: DeepSpeed's node-group (hpZ) path from the slots (``ds_secondary_tensor``).
    SERVED = 0
    #: Misses of the engine's DP group: :meth:`HierarchicalGather.issue`.
    TWO_STAGE = 1
    #: DeepSpeed's own gather over the parameter's group (the ``flat`` mode, or a fallback with a reason).
    FLAT = 2


@dataclass(frozen=True)
class FetchPart:
    """Parameters gathered by one route over one group, ``ds_id`` ascending."""

    route: Route
    params: tuple[torch.nn.Parameter, ...]
    #: Why a FLAT part does not take the two-stage gather ("" in the ``flat`` mode and for other routes).
    reason: str = ""


def route_of(param: torch.nn.Parameter, gather: Optional[HierarchicalGather], quantize: bool) -> tuple[Route, str]:
    """The route of one parameter of a fetch, and the fallback reason of a FLAT one."""
    if param.ds_secondary_tensor is not None:
        return Route.SERVED, ""
    if gather is None:
        return Route.FLAT, ""
    reason = gather.unsupported([param], quantize)
    return (Route.FLAT, reason) if reason else (Route.TWO_STAGE, "")


def split_fetch(params: Sequence[torch.nn.Parameter], gather: Optional[HierarchicalGather],
                quantize: bool) -> list[FetchPart]:
    """The parts of one fetch, in the order to issue them (see [Note: one fetch, several collectives])."""
    parts: dict[tuple, list] = {}
    for p in sorted(params, key=lambda q: q.ds_id):
        route, reason = route_of(p, gather, quantize)
        # the group object keys the split, as DeepSpeed's own (params_by_group); the order uses ds_ids only
        parts.setdefault((route, reason, id(p.ds_process_group)), []).append(p)
    ordered = sorted(parts.items(), key=lambda kv: (kv[0][0].value, kv[1][0].ds_id))
    return [FetchPart(route, tuple(ps), reason) for (route, reason, _), ps in ordered]
