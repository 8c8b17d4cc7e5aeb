"""DiLoCo's part of a checkpoint: the outer shards, momentum, residuals, the step counter and the exchange in flight
of one rank.

Registered as the ``"diloco"`` part of the ``fcdp_compression`` envelope (``compress/state.py``) in each rank's
optimizer state file; ``diloco/files.py`` makes every node write (and read back) its own files. A checkpoint
without the part, or of another layout (sub-group sizes, node count, codec), restarts the outer state from the
loaded fp32 masters with zero momentum and residuals (exact only when saved at a sync boundary) and the step
counter at 0; a universal checkpoint (which drops the envelope) does the same.

[Note: a checkpoint with an exchange in flight] Saved between a fragment's issue and its completion (streaming,
``overlap_steps`` > 0), the part holds this rank's message (already encoded, its residual already updated) and the
step it completes at; the load issues the same all-gather again with it. Every peer saved its own message in its
own file, so the peers' messages arrive as they did in the run that saved, and the completion computes bitwise
what it would have (tested: a resume mid-overlap continues bit for bit).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from fcdp_deepspeed.diloco.layout import check_same_start
from fcdp_deepspeed.diloco.sync import DiLoCoSync, Pending
from fcdp_deepspeed.machine import device

#: Bumped when the part's content changes.
VERSION = 2


class DiLoCoState:
    """The ``StatePart`` of one engine's :class:`DiLoCoSync`."""

    def __init__(self, sync: DiLoCoSync, masters: Callable[[], Sequence[torch.Tensor]], peer_group: Any) -> None:
        self.sync, self.masters, self.peer_group = sync, masters, peer_group

    def _layout(self) -> dict:
        cfg = self.sync.config
        return {**self.sync.layout, "numels": self.sync.outer.numels, "compression": cfg.compression,
                "fragments": cfg.fragments, "overlap_steps": cfg.overlap, "sync_every": cfg.sync_every,
                **({"warmup_steps": cfg.warmup_steps} if cfg.warmup_steps else {})}

    def state(self) -> dict:
        tensors = {k: None if v is None else [t.clone() for t in v] for k, v in self.sync.outer.tensors().items()}
        pending = self.sync.pending
        in_flight = None if pending is None else {
            "fragment": pending.fragment, "issued": pending.issued, "due": pending.due,
            "drift_sq": float(device.small_to_host(pending.drift_sq.view(1))[0]),
            "messages": [device.to_host(f.message, out=device.host_empty(f.message.numel(), f.message.dtype))
                         for f in pending.flights]}
        if in_flight is not None:
            device.host_wait(device.record_event())
        return {"version": VERSION, "layout": self._layout(), "steps": self.sync.steps, "syncs": self.sync.syncs,
                "in_flight": in_flight, **tensors}

    def load_state(self, saved: Optional[Mapping[str, Any]]) -> None:
        """Collective over the node peers (``load_checkpoint`` runs on every rank): the restored outer shards must
        agree across nodes."""
        outer = self.sync.outer
        if saved is None or saved.get("version") != VERSION or saved.get("layout") != self._layout():
            self.sync.reset_outer(self.masters())
        else:
            for name, mine in outer.tensors().items():
                if mine is not None:
                    for dst, src in zip(mine, saved[name]):
                        dst.copy_(src)
            self.sync.steps, self.sync.syncs = int(saved["steps"]), int(saved["syncs"])
            self._reissue(saved.get("in_flight"))
        check_same_start(self.sync.outer.params, self.peer_group, "outer parameters after the checkpoint load")

    def _reissue(self, in_flight: Optional[Mapping[str, Any]]) -> None:
        """[Note: a checkpoint with an exchange in flight]: the saved messages sent again, in piece order."""
        self.sync.drop_pending()
        if in_flight is None:
            return
        pieces = self.sync.fragments[in_flight["fragment"]]
        flights = [self.sync.exchange.start(device.to_accel(m, out=device.accel_empty(m.numel(), m.dtype)), p.length)
                   for p, m in zip(pieces, in_flight["messages"])]
        drift_sq = device.small_to_accel([in_flight["drift_sq"]], torch.float64).view(())
        self.sync.pending = Pending(int(in_flight["fragment"]), int(in_flight["issued"]), int(in_flight["due"]),
                                    flights, drift_sq)

    def reset(self, why: str) -> None:
        """The weights were rewritten without the optimizer state: outer := the masters, zero momentum and
        residuals, no collective ([Note: weights rewritten without the optimizer state] in compress/state.py)."""
        self.sync.reset_outer(self.masters())
