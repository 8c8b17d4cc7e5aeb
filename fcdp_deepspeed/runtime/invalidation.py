"""Invalidation: which cache entries each value-changing event drops.

``stage3.py`` says *when* (the DeepSpeed events, listed there); this module says *which entries*.
Every event runs on all ranks of the data-parallel group at the same logical point, so hit/miss
decisions stay agreed (see [Note: threads] in ``fetch.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from fcdp_deepspeed.storage.cache import NodeCache


@dataclass(eq=False)
class Invalidation:
    """One engine's invalidation rules; fixed at engine creation."""

    cache: NodeCache
    #: ``ds_id`` of every parameter the optimizer owns (it writes them at each step).
    optimizer_ids: frozenset[int]
    #: ``fcdp.keep_frozen``: frozen parameters the optimizer does not own survive a step.
    keep_frozen: bool
    #: Called with the parameters of every event (before it is applied): the run-ahead's cancel (``runahead.py``).
    listeners: list[Callable[[list], None]] = field(default_factory=list)

    def _tell(self, params: Iterable[torch.nn.Parameter]) -> list:
        params = list(params)
        for listener in self.listeners:
            listener(params)
        return params

    def params(self, params: Iterable[torch.nn.Parameter], reason: str) -> int:
        """Drop the entries of ``params`` (those that have one); return how many were dropped."""
        params = self._tell(params)
        entries = [e for e in (self.cache.entry(p) for p in params) if e is not None]
        return self.cache.invalidate(entries, reason)

    def changed(self) -> None:
        """Optimizer step boundary: drop every entry the step may have changed.

        Kept: frozen params (``keep_frozen``) the optimizer does not own. A param unfrozen between
        steps requires grad now, so it is dropped too and never served as a stale "frozen" value.
        """
        stale = [e for e in self.cache.entries.values() if self.stepped(e.param)]
        self._tell(e.param for e in stale)
        self.cache.invalidate(stale, "optimizer_step")

    def stepped(self, param: torch.nn.Parameter) -> bool:
        """Whether an optimizer step may have changed ``param``: it requires grad now (an unfrozen one included), the
        optimizer owns it, or frozen parameters are not kept."""
        return param.requires_grad or param.ds_id in self.optimizer_ids or not self.keep_frozen

    def flush(self, reason: str) -> None:
        """Drop every entry (checkpoint events: frozen parameters may have been written too)."""
        self._tell(e.param for e in self.cache.entries.values())
        self.cache.invalidate(list(self.cache.entries.values()), reason)
