"""What each rank computes with, hashed: a forward pre-hook on every module with parameters (registered after
DeepSpeed's fetch hooks, so it sees the gathered ``param.data``) records the sha1 of each parameter's full value at
every call: training forwards, activation-checkpointing recomputes in backward, and eval forwards alike; and in
backward, where an identity autograd function on the module's inputs runs its backward after the module's own
(DeepSpeed gathered the parameters before it and releases them after: its release function sits on the inputs
before ours). Replicas are bitwise equal when every rank records the same sequence (an exact flat gather of each rank's partitions, compared
instead, agrees whatever each rank computed with)."""
from __future__ import annotations

import hashlib
from functools import partial

import torch


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class _Tap(torch.autograd.Function):
    """Identity; its backward calls ``callback`` first (the gradient passes unchanged)."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


class ReplicaHashes:
    """``hashes``: ``(step, phase, parameter, sha1)`` per parameter and call, phase ``train`` (a forward, or
    its recompute under activation checkpointing), ``backward`` (a module's backward, when an input needs a
    gradient) or ``eval``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.step = 0
        self.hashes: list = []
        names = {id(p): n for n, p in module.named_parameters()}
        for m in module.modules():
            own = [(names[id(p)], p) for p in m.parameters(recurse=False)]
            if own:
                m.register_forward_pre_hook(partial(self._hook, own))

    def _record(self, params, phase: str) -> None:
        for name, p in params:
            self.hashes.append((self.step, phase, name, digest(p.data)))

    def _hook(self, params, module, inputs):
        self._record(params, "train" if module.training else "eval")
        if not torch.is_grad_enabled() or not any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            return None
        tap = partial(self._record, params, "backward")
        return tuple(_Tap.apply(x, tap) if isinstance(x, torch.Tensor) and x.requires_grad else x for x in inputs)

    def phases(self) -> set:
        return {phase for _, phase, _, _ in self.hashes}
