"""The pseudo-gradient exchange: one rank's shard averaged with its node peers (the ranks at the same node position).

[Note: a fixed-order average] Every peer all-gathers the peers' messages and sums them in peer order, then divides
by N: the same bytes in the same order of torch ops on every peer, so every node gets bitwise the same average
whatever the backend's all-reduce algorithm does (a ring all-reduce may sum in a different order per rank). On two
nodes this moves the same bytes as an all-reduce; on N nodes each rank receives (N - 1) messages.

Compressed (``fcdp.diloco.compression`` int8/int4, ``compress/quant.py``): each rank sends ``encode(delta + r)``
and keeps the error ``r = (delta + r) - decode(...)`` for its next sync (error feedback across syncs); every peer
decodes every message, its own included ([Note: determinism] in ``compress/quant.py``). int4 rotates its blocks
(the gradients' codec): pseudo-gradients are heavy-tailed as gradients are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.compress.quant import Codec


@dataclass(eq=False)
class Flight:
    """One issued exchange: this rank's message (held until the work completes, as the backend requires), the
    peers' messages as they arrive, and the work handle."""

    numel: int
    message: torch.Tensor
    gathered: list[torch.Tensor]
    work: Any


class PseudoGradExchange:
    """Averages pseudo-gradient shards over a peer group of ``num_nodes`` ranks, optionally compressed."""

    def __init__(self, codec: Optional[Codec], peer_group: Any, num_nodes: int) -> None:
        self.codec, self.group, self.num_nodes = codec, peer_group, num_nodes
        #: Bytes this rank sent (its messages), since the engine was built.
        self.sent_bytes = 0

    def encode(self, delta: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """This rank's message for ``delta`` (fp32, 1-D, on the accelerator). With a codec, ``residual`` (same
        shape, same device) is read and updated in place (error feedback)."""
        if self.codec is None:
            return delta
        x = delta.add(residual)
        message, decoded = self.codec.roundtrip(x)
        residual.copy_(x.sub_(decoded))
        return message

    def start(self, message: torch.Tensor, numel: int) -> Flight:
        """Issue the all-gather of ``message`` over the peers (asynchronous: :meth:`finish` waits for it)."""
        gathered = [torch.empty_like(message) for _ in range(self.num_nodes)]
        work = dist.all_gather(gathered, message, group=self.group, async_op=True)
        self.sent_bytes += message.numel() * message.element_size()
        return Flight(numel, message, gathered, work)

    def finish(self, flight: Flight, wait: bool = True) -> torch.Tensor:
        """The peers' mean of the exchanged values (``wait=False`` is the test-only broken variant that reads
        the peers' messages before the work completes)."""
        if wait:
            flight.work.wait()
        total = None
        for m in flight.gathered:  # peer order: the same sum on every peer
            value = m if self.codec is None else self.codec.decode(m, flight.numel)
            total = value.clone() if total is None else total.add_(value)
        return total.div_(self.num_nodes)

    def average(self, delta: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """Encode, exchange and average at once (blocking)."""
        return self.finish(self.start(self.encode(delta, residual), delta.numel()))
