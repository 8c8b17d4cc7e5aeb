"""The move of cached slices to the accelerator after a measured step (``cache_device: auto`` and ``device``),
and the release of the host chunks the move emptied.

[Note: device budgets come from a measured step]
Accelerator memory at engine build says nothing about a step's needs: activations, prefetch buffers, the
reduce buckets and NCCL's buffers do not exist yet. So both accelerator modes start on the (pinned) host and,
after step ``PROMOTE_STEP`` (the first complete step: step 1 has no prefetch trace), each rank moves what
fits into the headroom that step left (:func:`~fcdp_deepspeed.storage.memory.measured_device_headroom`: total minus
the allocator's peak *reserved* memory, minus memory outside the allocator such as NCCL's communicators and
the CUDA context, minus :func:`~fcdp_deepspeed.storage.memory.device_margin`). ``device_budget`` is resolved against
that headroom (``auto`` mode: half of it by default; ``device`` mode: all of it) and never exceeds it.
Placement is per rank: which parameters are cached does not change, so no agreement is needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.reporting.stats import fmt_bytes
from fcdp_deepspeed.storage import memory
from fcdp_deepspeed.storage.cache import NodeCache, Placement, SlotPool
from fcdp_deepspeed.storage.placement import SlotRequest, plan_placement

#: Optimizer step boundary at which the accelerator modes measure and move: the first step has no prefetch
#: trace yet, so only the second has run a complete step (prefetch included).
PROMOTE_STEP = 2
#: ``device_budget: auto`` as a fraction of the measured headroom, per mode.
AUTO_FRACTION = {"auto": 0.5, "device": 1.0}


@dataclass(eq=False)
class Promotion:
    """One engine's move to the accelerator (once) and the release of what it emptied (deferred)."""

    config: FCDPConfig
    cache: NodeCache
    steps: int = 0
    promoted: bool = False
    #: The measured headroom and the budget resolved against it (``None`` before the move).
    headroom: Optional[int] = None
    budget: Optional[int] = None
    moved_bytes: int = 0
    #: Other holders of accelerator memory placed at the same measured step, before the cache: each is handed the
    #: headroom and returns the bytes it took (the node gradient buffer and residuals, ``grad_buffer_device: device``,
    #: [Note: the device buffer comes from a measured step] in ``grads/buffer.py``), and reaps what it emptied.
    claims: list[Callable[[int], int]] = field(default_factory=list)
    reapers: list[Callable[[], None]] = field(default_factory=list)

    def on_step_end(self) -> None:
        self.steps += 1
        if (self.config.cache_device in AUTO_FRACTION or self.claims) and not self.promoted and self.steps >= PROMOTE_STEP:
            self.promoted = True
            self._promote()
        for pool in self.cache.pools.values():
            if pool is not None and pool.retired:
                pool.reap()
        for reap in self.reapers:
            reap()

    def _promote(self) -> None:
        acc = get_accelerator()
        self.headroom = memory.measured_device_headroom(acc.total_memory(), acc.max_memory_reserved(),
                                                        acc.memory_reserved(), acc.available_memory())
        for claim in self.claims:  # what they take was not in the measured peak: the cache may not take it again
            self.headroom -= min(self.headroom, claim(self.headroom))
        if self.config.cache_device not in AUTO_FRACTION:
            return
        fraction = AUTO_FRACTION[self.config.cache_device]
        self.budget = min(self.headroom, self.config.device_budget_spec.resolve(self.headroom, auto_fraction=fraction))
        host = [e for e in self.cache.entries.values() if e.placement is Placement.HOST]
        plan = plan_placement([SlotRequest(e.param.ds_id, e.nbytes, frozen=not e.param.requires_grad) for e in host],
                              "device", host_budget=0, device_budget=self.budget)
        chosen = [e for e in host if plan[e.param.ds_id] is Placement.DEVICE]
        if not chosen:
            return
        pool = self.cache.pools[Placement.DEVICE] or SlotPool(Placement.DEVICE, pin=False)
        self.cache.pools[Placement.DEVICE] = pool
        moved = self.cache.move(chosen, pool)
        self.moved_bytes = sum(e.nbytes for e in moved)
        self.cache.pools[Placement.HOST].release_unused(self.cache.entries.values(), last_use=self.cache.copies.last_move)
        if dist.get_rank() == 0:
            logger.info(f"fcdp: moved {len(moved)} cached slices ({fmt_bytes(self.moved_bytes)}) to the accelerator "
                        f"(headroom after step {self.steps}: {fmt_bytes(self.headroom)}, budget {fmt_bytes(self.budget)})")
