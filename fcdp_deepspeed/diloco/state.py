"""DiLoCo's part of a checkpoint: the outer shards, momentum, residuals and the step counter of one rank.

Registered as the ``"diloco"`` part of the ``fcdp_compression`` envelope (``compress/state.py``) in each rank's
optimizer state file; ``diloco/files.py`` makes every node write (and read back) its own files. A checkpoint
without the part, or of another layout (sub-group sizes, node count, codec), restarts the outer state from the
loaded fp32 masters with zero momentum and residuals (exact only when saved at a sync boundary) and the step
counter at 0; a universal checkpoint (which drops the envelope) does the same.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from fcdp_deepspeed.diloco.layout import check_same_start
from fcdp_deepspeed.diloco.sync import DiLoCoSync

#: Bumped when the part's content changes.
VERSION = 1


class DiLoCoState:
    """The ``StatePart`` of one engine's :class:`DiLoCoSync`."""

    def __init__(self, sync: DiLoCoSync, masters: Callable[[], Sequence[torch.Tensor]], peer_group: Any) -> None:
        self.sync, self.masters, self.peer_group = sync, masters, peer_group

    def _layout(self) -> dict:
        return {**self.sync.layout, "numels": self.sync.outer.numels, "compression": self.sync.config.compression}

    def state(self) -> dict:
        tensors = {k: None if v is None else [t.clone() for t in v] for k, v in self.sync.outer.tensors().items()}
        return {"version": VERSION, "layout": self._layout(), "steps": self.sync.steps, "syncs": self.sync.syncs,
                **tensors}

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
        check_same_start(self.sync.outer.params, self.peer_group, "outer parameters after the checkpoint load")
