"""DiLoCo's outer state on one rank: its 1/L shard of the outer parameters, the outer momentum and the
compression residuals, fp32 in (pinned) host memory, one tensor per stage-3 sub-group; and the outer step.

[Note: the outer step] ``torch.optim.SGD(momentum=mu, dampening=0, nesterov=...)`` applied to the averaged
pseudo-gradient ``g`` (outer - local, as DiLoCo and torchft define it): ``m = mu * m + g``; the update is
``g + mu * m`` (Nesterov) or ``m``; ``outer -= lr * update``. A fresh momentum of zeros gives ``m = g`` on the
first sync, as SGD's first step does. Every node runs it on bitwise equal inputs in the same order of
elementwise torch ops, so every node gets bitwise the same outer parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fcdp_deepspeed.machine import device


def _copy_master(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (pinned host fp32) := the master ``t``; from the accelerator asynchronously (the caller waits)."""
    if t.device.type == "cpu":
        out.copy_(t.detach().view(-1))
    else:
        device.to_host(t.detach().view(-1).float(), out=out)
    return out


@dataclass(eq=False)
class OuterState:
    """This rank's outer shards (fp32, host): ``params[i]``/``momentum[i]``/``residual[i]`` for sub-group ``i``."""

    params: list[torch.Tensor]
    momentum: list[torch.Tensor]
    residual: Optional[list[torch.Tensor]]

    @classmethod
    def from_masters(cls, masters: Sequence[torch.Tensor], with_residual: bool) -> "OuterState":
        """Outer parameters equal to the fp32 masters, zero momentum (and residuals)."""
        params = [device.pin_empty(m.numel(), torch.float32) for m in masters]
        momentum = [device.pin_empty(p.numel(), torch.float32).zero_() for p in params]
        residual = [device.pin_empty(p.numel(), torch.float32).zero_() for p in params] if with_residual else None
        state = cls(params, momentum, residual)
        state.restart_from(masters)
        return state

    def restart_from(self, masters: Sequence[torch.Tensor]) -> None:
        """Outer parameters := the fp32 masters in place (at the build, and at the end of the warm-up, when momentum
        and residuals are still zero: nothing was synced before)."""
        for dst, m in zip(self.params, masters):
            _copy_master(m, dst)
        if any(m.device.type != "cpu" for m in masters):
            device.host_wait(device.record_event())  # the copies land before anyone reads them on the host

    @property
    def numels(self) -> list[int]:
        return [p.numel() for p in self.params]

    @property
    def nbytes(self) -> int:
        return sum(4 * n for n in self.numels) * (3 if self.residual is not None else 2)

    def tensors(self) -> dict[str, Optional[list[torch.Tensor]]]:
        return {"outer": self.params, "momentum": self.momentum, "residual": self.residual}


def outer_step_(outer: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, lr: float, mu: float,
                nesterov: bool) -> torch.Tensor:
    """One outer SGD step in place (see [Note: the outer step]); returns the applied step ``lr * update``."""
    momentum.mul_(mu).add_(grad)
    update = grad.add(momentum, alpha=mu) if nesterov else momentum.clone()
    update.mul_(lr)
    outer.sub_(update)
    return update
