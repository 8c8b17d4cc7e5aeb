"""Where each cached slice lives: a pure function of sizes, budgets and mode.

Kept free of tensors and collectives so the policy is unit-testable; the runtime applies it and
makes the *cached or not* outcome agree across ranks (placement itself may differ per rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from fcdp_deepspeed.storage.cache import Placement


@dataclass(frozen=True)
class SlotRequest:
    key: int
    nbytes: int
    frozen: bool


def placement_order(requests: Sequence[SlotRequest]) -> list[SlotRequest]:
    """Frozen first: their slices are reused by every fetch of every step, trainable ones only
    within a step. Then by key (``ds_id``) so every rank walks the same order."""
    return sorted(requests, key=lambda r: (not r.frozen, r.key))


def plan_placement(requests: Sequence[SlotRequest], mode: str, host_budget: int,
                   device_budget: int) -> dict[int, Optional[Placement]]:
    """Greedy fill: the accelerator first (``device`` mode only), then the host; ``None`` = uncached."""
    plan: dict[int, Optional[Placement]] = {}
    host_used = device_used = 0
    for req in placement_order(requests):
        if mode == "device" and device_used + req.nbytes <= device_budget:
            plan[req.key] = Placement.DEVICE
            device_used += req.nbytes
        elif host_used + req.nbytes <= host_budget:
            plan[req.key] = Placement.HOST
            host_used += req.nbytes
        else:
            plan[req.key] = None
    return plan
