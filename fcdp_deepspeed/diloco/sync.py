"""The outer sync: every ``sync_every`` optimizer steps, pseudo-gradients averaged over the nodes, the outer step,
and every partition of the replica set from the new outer parameters.

[Note: counting steps] Every ``step()`` the engine calls counts, overflow-skipped ones included (DeepSpeed's step
returns before ``_post_step`` on an overflow), so every node syncs at the same step whatever its loss scaler did;
a node that skipped simply contributes its unchanged weights. Every rank must run the same number of steps.

[Note: writing the partitions] Per sub-group: the fp32 master is overwritten with the outer shard and
``_reassign_or_swap_out_partitioned_parameters`` copies it into the 16-bit partitions (the path DeepSpeed's own
step takes, which also runs ``_unflatten_partitioned_parameters``, FCDP's invalidation event). Before it, every
parameter is released (``_partition_all_parameters``, as a checkpoint does: persistent parameters were gathered
again by ``_post_step``); after it, persistent parameters are gathered again and secondary copies invalidated, as
``_post_step`` does. The inner optimizer's state (Adam moments) is kept, as DiLoCo does.

[Note: the host waits once per sync] The outer shards live in host memory; each sub-group's shards are copied to
the accelerator, combined there (the collective needs accelerator tensors), and copied back; the host waits for
those copies at the end of the sync, once every ``sync_every`` steps, so checkpoints may read them at any time.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from deepspeed import comm as dist

from fcdp_deepspeed import device
from fcdp_deepspeed.diloco.config import DiLoCoConfig
from fcdp_deepspeed.diloco.exchange import PseudoGradExchange
from fcdp_deepspeed.diloco.layout import mask_padding_
from fcdp_deepspeed.diloco.outer import OuterState, outer_step_


def _on_accel(host: torch.Tensor) -> torch.Tensor:
    return device.to_accel(host, out=device.accel_empty(host.numel(), host.dtype))


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` (a master on the accelerator, or on the host under optimizer offload) := ``src`` (accelerator)."""
    if device.current().is_host(dst):
        device.to_host(src, out=dst.view(-1))
    else:
        dst.view(-1).copy_(src)


class DiLoCoSync:
    """One engine's DiLoCo: the step counter, the outer state, the exchange and the statistics."""

    def __init__(self, config: DiLoCoConfig, exchange: PseudoGradExchange, node_group: Any,
                 ranges: Sequence[Sequence[tuple[int, int]]], outer: OuterState, layout: dict) -> None:
        self.config, self.exchange, self.node_group = config, exchange, node_group
        self.ranges, self.outer, self.layout = list(ranges), outer, layout
        #: ``step()`` calls since the engine was built (or restored from a checkpoint).
        self.steps = 0
        self.syncs = 0
        self.drift_norms: list[float] = []
        self.step_norms: list[float] = []

    def after_step(self, optimizer: Any) -> bool:
        """Count one optimizer step; sync when it closes an interval. Returns whether it synced."""
        self.steps += 1
        if self.steps % self.config.sync_every:
            return False
        self.sync(optimizer)
        return True

    @torch.no_grad()
    def sync(self, optimizer: Any) -> None:
        optimizer._partition_all_parameters()
        cfg = self.config
        squares = torch.zeros(2, dtype=torch.float64, device=device.accel_device())
        for i, master in enumerate(optimizer.fp32_partitioned_groups_flat):
            outer = _on_accel(self.outer.params[i])
            momentum = _on_accel(self.outer.momentum[i])
            residual = None if self.outer.residual is None else _on_accel(self.outer.residual[i])
            delta = mask_padding_(outer - device.to_accel(master.detach().view(-1)).float(), self.ranges[i])
            squares[0] += delta.double().square().sum()
            mean = self.exchange.average(delta, residual)
            applied = outer_step_(outer, momentum, mean, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov)
            squares[1] += applied.double().square().sum()
            _write(master, outer)
            device.to_host(outer, out=self.outer.params[i])
            device.to_host(momentum, out=self.outer.momentum[i])
            if residual is not None:
                device.to_host(residual, out=self.outer.residual[i])
            optimizer._reassign_or_swap_out_partitioned_parameters(i)
        dist.all_reduce(squares, group=self.node_group)  # the node's norms: every rank of the node holds one shard
        device.host_wait(device.record_event())  # [Note: the host waits once per sync]
        drift, step = (math.sqrt(v) for v in device.small_to_host(squares))
        self.drift_norms.append(drift)
        self.step_norms.append(step)
        self.syncs += 1
        if optimizer.persistent_parameters:
            optimizer.persistent_parameters[0].all_gather(optimizer.persistent_parameters)
        optimizer.invalidate_secondary_tensor()

    def reset_outer(self, masters: Sequence[torch.Tensor], steps: int = 0) -> None:
        """Outer parameters := the masters, zero momentum and residuals (a checkpoint without DiLoCo state)."""
        self.outer = OuterState.from_masters(masters, self.outer.residual is not None)
        self.steps = steps

    def stats(self) -> dict:
        last = lambda xs: xs[-1] if xs else 0.0  # noqa: E731
        return {
            "diloco_enabled": True, "diloco_sync_every": self.config.sync_every, "diloco_steps": self.steps,
            "diloco_syncs": self.syncs, "diloco_compression": self.config.compression,
            "diloco_pseudo_grad_bytes": self.exchange.sent_bytes,
            "diloco_outer_step_norm": last(self.step_norms), "diloco_drift_norm": last(self.drift_norms),
            "diloco_drift_norms": list(self.drift_norms), "diloco_outer_step_norms": list(self.step_norms),
            "diloco_outer_host_bytes": self.outer.nbytes,
        }
