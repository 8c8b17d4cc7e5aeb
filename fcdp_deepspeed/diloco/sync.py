"""The outer sync: every ``sync_every`` optimizer steps (one fragment every ``sync_every / fragments`` with streaming),
pseudo-gradients averaged over the nodes, the outer step, and the fragment's partitions of the replica set from the
new outer parameters.

[Note: counting steps] Every ``step()`` the engine calls counts, overflow-skipped ones included (DeepSpeed's step
returns before ``_post_step`` on an overflow), so every node syncs at the same step whatever its loss scaler did;
a node that skipped simply contributes its unchanged weights. Every rank must run the same number of steps.

[Note: issue, then complete] A fragment's exchange is issued after the step that closes its interval: the
pseudo-gradient ``outer - local`` of its pieces is taken then (a snapshot: the fp32 masters keep training), encoded
(the residual updated), and its all-gather started asynchronously. ``overlap_steps`` steps later (at once with 0)
it is completed: the work waited, the peers' messages summed in peer order, the outer step, and the fragment's
elements of the fp32 master set to the new outer values, so right after a fragment's sync every rank of every node
holds bitwise the same values there. The local progress those elements made while the exchange ran is dropped
(Streaming DiLoCo's merge with alpha = 0, arXiv 2501.18512; torchft's ``fragment_update_alpha`` default): any
other merge leaves the nodes' copies different. The outer state of a fragment is read and written only at its
completion, and the next issue of the same fragment is ``sync_every`` steps later.

[Note: writing the partitions] Per sub-group touched: ``_reassign_or_swap_out_partitioned_parameters`` copies the
fp32 master into the 16-bit partitions (the path DeepSpeed's own step takes, which also runs
``_unflatten_partitioned_parameters``, FCDP's invalidation event; elements outside the fragment are rewritten with
the values the last step gave them). Before it, every parameter is released (``_partition_all_parameters``, as a
checkpoint does: persistent parameters were gathered again by ``_post_step``); after it, persistent parameters
are gathered again and secondary copies invalidated, as ``_post_step`` does. The inner optimizer's state (Adam
moments) is kept, as DiLoCo does.

[Note: the host waits once per sync] The outer shards live in host memory; each piece's shards are copied to the
accelerator, combined there (the collective needs accelerator tensors), and copied back; the host waits for
those copies at the end of an issue and of a completion, so checkpoints may read them at any time. It never
waits for an exchange in flight: only the completion's ``wait()`` orders the peers' messages before their use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.config.diloco import DiLoCoConfig
from fcdp_deepspeed.diloco.exchange import Flight, PseudoGradExchange
from fcdp_deepspeed.diloco.fragments import Piece, fragment_due, piece_ranges, plan_fragments
from fcdp_deepspeed.diloco.layout import mask_padding_
from fcdp_deepspeed.diloco.outer import OuterState, outer_step_
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.storage import freshness


def _on_accel(host: torch.Tensor) -> torch.Tensor:
    return device.to_accel(host, out=device.accel_empty(host.numel(), host.dtype))


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` (a master's piece on the accelerator, or on the host under optimizer offload) := ``src`` (accelerator)."""
    if device.current().is_host(dst):
        device.to_host(src, out=dst)
    else:
        dst.copy_(src)


def _piece(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    return t.view(-1).narrow(0, piece.start, piece.length)


@dataclass(eq=False)
class Pending:
    """A fragment's exchange in flight: issued after step ``issued``, completed after step ``due``."""

    fragment: int
    issued: int
    due: int
    flights: list[Flight]
    drift_sq: torch.Tensor


class DiLoCoSync:
    """One engine's DiLoCo: the step counter, the outer state, the exchange, the fragment in flight, the statistics."""

    def __init__(self, config: DiLoCoConfig, exchange: PseudoGradExchange, node_group: Any,
                 ranges: Sequence[Sequence[tuple[int, int]]], outer: OuterState, layout: dict) -> None:
        self.config, self.exchange, self.node_group = config, exchange, node_group
        self.ranges, self.outer, self.layout = list(ranges), outer, layout
        self.fragments = plan_fragments(outer.numels, config.fragments)
        #: ``step()`` calls since the engine was built (or restored from a checkpoint).
        self.steps = 0
        #: Completed fragment syncs (whole-model syncs with one fragment).
        self.syncs = 0
        self.pending: Optional[Pending] = None
        #: (fragment, issued after step, completed after step) of the last completed sync.
        self.last: Optional[tuple[int, int, int]] = None
        self.drift_norms: list[float] = []
        self.step_norms: list[float] = []
        #: Bytes this rank sent averaging gradients in the warm-up (since the engine was built).
        self.warmup_bytes = 0

    @property
    def in_warmup(self) -> bool:
        """Whether the next optimizer step is a warm-up step ([Note: the warm-up] in ``diloco/warmup.py``)."""
        return self.steps < self.config.warmup_steps

    def after_step(self, optimizer: Any) -> bool:
        """Count one optimizer step; complete the fragment due now, issue the next one ([Note: the schedule] in
        ``diloco/fragments.py``, counted from the end of the warm-up). Returns whether a fragment sync completed."""
        self.steps += 1
        warmup = self.config.warmup_steps
        if self.steps <= warmup:
            if self.steps == warmup:  # every node holds the same masters: the outer parameters start there
                self.outer.restart_from(optimizer.fp32_partitioned_groups_flat)
            return False
        done = False
        if self.pending is not None and self.pending.due <= self.steps:
            self.complete(optimizer)
            done = True
        fragment = fragment_due(self.steps - warmup, self.config.interval, self.config.fragments)
        if fragment is not None:
            self.pending = self.issue(optimizer, fragment)
            if self.config.overlap == 0:
                self.complete(optimizer)
                done = True
        return done

    @torch.no_grad()
    def issue(self, optimizer: Any, fragment: int) -> Pending:
        """Snapshot the fragment's pseudo-gradient, encode it, start its exchange ([Note: issue, then complete])."""
        drift_sq = torch.zeros((), dtype=torch.float64, device=device.accel_device())
        flights = []
        for piece in self.fragments[fragment]:
            local = device.to_accel(_piece(optimizer.fp32_partitioned_groups_flat[piece.group].detach(), piece))
            delta = mask_padding_(_on_accel(_piece(self.outer.params[piece.group], piece)) - local.float(),
                                  piece_ranges(self.ranges[piece.group], piece))
            drift_sq += delta.double().square().sum()
            residual = None if self.outer.residual is None else _on_accel(_piece(self.outer.residual[piece.group], piece))
            message = self.exchange.encode(delta, residual)
            if residual is not None:
                device.to_host(residual, out=_piece(self.outer.residual[piece.group], piece))
            flights.append(self.exchange.start(message, piece.length))
        device.host_wait(device.record_event())  # [Note: the host waits once per sync]
        return Pending(fragment, self.steps, self.steps + self.config.overlap, flights, drift_sq)

    @torch.no_grad()
    def complete(self, optimizer: Any) -> None:
        """Wait for the fragment in flight, take the outer step, set the fragment's partitions from it."""
        pending, self.pending = self.pending, None
        cfg = self.config
        optimizer._partition_all_parameters()
        squares = torch.zeros(2, dtype=torch.float64, device=device.accel_device())
        squares[0] += pending.drift_sq
        pieces = self.fragments[pending.fragment]
        for piece, flight in zip(pieces, pending.flights):
            mean = self.exchange.finish(flight)
            outer_host, momentum_host = _piece(self.outer.params[piece.group], piece), \
                _piece(self.outer.momentum[piece.group], piece)
            outer, momentum = _on_accel(outer_host), _on_accel(momentum_host)
            applied = outer_step_(outer, momentum, mean, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov)
            squares[1] += applied.double().square().sum()
            _write(_piece(optimizer.fp32_partitioned_groups_flat[piece.group], piece), outer)
            device.to_host(outer, out=outer_host)
            device.to_host(momentum, out=momentum_host)
        self.reassign(optimizer, pieces)
        dist.all_reduce(squares, group=self.node_group)  # the node's norms: every rank of the node holds one shard
        device.host_wait(device.record_event())  # [Note: the host waits once per sync]
        drift, step = (math.sqrt(v) for v in device.small_to_host(squares))
        self.drift_norms.append(drift)
        self.step_norms.append(step)
        self.syncs += 1
        self.last = (pending.fragment, pending.issued, self.steps)
        if optimizer.persistent_parameters:
            optimizer.persistent_parameters[0].all_gather(optimizer.persistent_parameters)
        optimizer.invalidate_secondary_tensor()

    @staticmethod
    def reassign(optimizer: Any, pieces: Sequence[Piece]) -> None:
        """The 16-bit partitions the forward uses set from the fragment's new fp32 master (and stamped written)."""
        for group in sorted({p.group for p in pieces}):
            optimizer._reassign_or_swap_out_partitioned_parameters(group)
            freshness.written(optimizer.fp16_groups[group], freshness.Write.OUTER)

    def drop_pending(self) -> None:
        """Wait out the exchange in flight (every peer issued it) and forget it."""
        if self.pending is not None:
            for flight in self.pending.flights:
                flight.work.wait()
            self.pending = None

    def reset_outer(self, masters: Sequence[torch.Tensor], steps: int = 0) -> None:
        """Outer parameters := the masters, zero momentum and residuals (a checkpoint without DiLoCo state)."""
        self.drop_pending()
        self.outer = OuterState.from_masters(masters, self.outer.residual is not None)
        self.steps = steps

    def stats(self) -> dict:
        last = lambda xs: xs[-1] if xs else 0.0  # noqa: E731
        return {
            "diloco_enabled": True, "diloco_sync_every": self.config.sync_every, "diloco_steps": self.steps,
            "diloco_syncs": self.syncs, "diloco_compression": self.config.compression,
            "diloco_fragments": self.config.fragments, "diloco_overlap_steps": self.config.overlap,
            "diloco_warmup_steps": self.config.warmup_steps, "diloco_in_warmup": self.in_warmup,
            "diloco_warmup_grad_bytes": self.warmup_bytes,
            "diloco_in_flight": self.pending is not None,
            "diloco_pseudo_grad_bytes": self.exchange.sent_bytes,
            "diloco_outer_step_norm": last(self.step_norms), "diloco_drift_norm": last(self.drift_norms),
            "diloco_drift_norms": list(self.drift_norms), "diloco_outer_step_norms": list(self.step_norms),
            "diloco_outer_host_bytes": self.outer.nbytes,
        }
