"""What each rank computes with, hashed: a forward pre-hook on every module with parameters (registered after
DeepSpeed's fetch hooks, so it sees the gathered ``param.data``) records the sha1 of each parameter's full value at
every call: training forwards, activation-checkpointing recomputes in backward, and eval forwards alike. Replicas are
bitwise equal when every rank records the same sequence (an exact flat gather of each rank's partitions, compared
instead, agrees whatever each rank computed with)."""
from __future__ import annotations

import hashlib
from functools import partial

import torch


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class ReplicaHashes:
    """``hashes``: ``(step, phase, parameter, sha1)`` per parameter and call, phase ``train`` (a forward, or
    its recompute under activation checkpointing: ``torch.is_grad_enabled()`` in backward too) or ``eval``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.step = 0
        self.hashes: list = []
        names = {id(p): n for n, p in module.named_parameters()}
        for m in module.modules():
            own = [(names[id(p)], p) for p in m.parameters(recurse=False)]
            if own:
                m.register_forward_pre_hook(partial(self._hook, own))

    def _hook(self, params, module, inputs) -> None:
        phase = "train" if module.training else "eval"
        for name, p in params:
            self.hashes.append((self.step, phase, name, digest(p.data)))

    def phases(self) -> set:
        return {phase for _, phase, _, _ in self.hashes}
