"""The pseudo-gradient exchange: one rank's shard averaged with its node peers (the ranks at the same node position).

[Note: a fixed-order average] Every peer all-gathers the peers' messages and sums them in peer order, then divides
by N: the same bytes in the same order of torch ops on every peer, so every node gets bitwise the same average
whatever the backend's all-reduce algorithm does (a ring all-reduce may sum in a different order per rank). On two
nodes this moves the same bytes as an all-reduce; on N nodes each rank receives (N - 1) messages.

[Note: two stages on more than two nodes] Uncompressed, on N > 2 nodes, with a blocking sync (``overlap_steps`` 0),
the average is a fixed-order reduce-scatter and an all-gather instead: each peer sends the i-th of N equal slices
of its message to peer i (an all-to-all), peer i sums the N slices it receives in peer order and divides by N, and
the peers all-gather the averaged slices. Each element is summed once, on one peer, by the formula the all-gather
path uses on every peer (the same adds in the same order), so the result is bitwise that of the all-gather path,
and every node receives the same bits; each rank sends 2 (N - 1) / N of a message instead of N - 1 (0.75x on 3
nodes, 0.5x on 4, 0.25x on 8). On two nodes the two are the same bytes and the single all-gather is kept. A
streaming exchange keeps the all-gather (its second stage would run at the completion, outside the overlap), and
so does a codec (the averaged slices would need a second rounding).

Compressed (``fcdp.diloco.compression`` int8/int4, ``compress/quant.py``): each rank sends ``encode(delta + r)``
and keeps the error ``r = (delta + r) - decode(...)`` for its next sync (error feedback across syncs); every peer
decodes every message, its own included ([Note: determinism] in ``compress/quant.py``). int4 rotates its blocks
(the gradients' codec): pseudo-gradients are heavy-tailed as gradients are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

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
    #: Two stages ([Note: two stages on more than two nodes]): the slice length; ``gathered`` is then the one
    #: all-to-all output, the peers' slices of this rank's part in peer order. 0: the all-gather.
    slice: int = 0


def mean_in_peer_order(parts: Sequence[torch.Tensor], num_nodes: int) -> torch.Tensor:
    """The peers' values summed in fp32 in peer order, divided by N ([Note: a fixed-order average]; fp32, summed in
    place into ``parts[0]`` when that is fp32 already)."""
    total = parts[0].float()
    for m in parts[1:]:
        total.add_(m.float())
    return total.div_(num_nodes)


def padded_slices(message: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, int]:
    """``message`` as ``num_nodes`` equal slices back to back (the last padded with zeros) and the slice length: what
    the first of two stages sends ([Note: two stages on more than two nodes])."""
    width = -(-message.numel() // num_nodes)
    if message.numel() == num_nodes * width:
        return message, width
    send = torch.zeros(num_nodes * width, dtype=message.dtype, device=message.device)
    send.narrow(0, 0, message.numel()).copy_(message)
    return send, width


def all_gather_slices(mine: torch.Tensor, num_nodes: int, group: Any) -> torch.Tensor:
    """The second of two stages: every peer's averaged slice, in peer order, as one tensor of ``num_nodes`` slices."""
    out = torch.empty(num_nodes * mine.numel(), dtype=mine.dtype, device=mine.device)
    dist.all_gather(list(out.view(num_nodes, -1).unbind(0)), mine, group=group)
    return out


class PseudoGradExchange:
    """Averages pseudo-gradient shards over a peer group of ``num_nodes`` ranks, optionally compressed."""

    def __init__(self, codec: Optional[Codec], peer_group: Any, num_nodes: int, blocking: bool = True) -> None:
        self.codec, self.group, self.num_nodes = codec, peer_group, num_nodes
        #: [Note: two stages on more than two nodes]
        self.two_stage = codec is None and num_nodes > 2 and blocking
        #: Bytes this rank sent since the engine was built (gloo's ring): ``N - 1`` messages per all-gather,
        #: ``2 (N - 1)`` slices per two-stage exchange.
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
        """Issue the all-gather of ``message`` over the peers, or the first stage of the two (asynchronous:
        :meth:`finish` waits for it)."""
        if self.two_stage:
            n = self.num_nodes
            send, width = padded_slices(message, n)
            received = torch.empty_like(send)
            work = dist.all_to_all_single(received, send, group=self.group, async_op=True)
            self.sent_bytes += 2 * (n - 1) * width * send.element_size()
            return Flight(numel, send, [received], work, slice=width)
        gathered = [torch.empty_like(message) for _ in range(self.num_nodes)]
        work = dist.all_gather(gathered, message, group=self.group, async_op=True)
        self.sent_bytes += (self.num_nodes - 1) * message.numel() * message.element_size()
        return Flight(numel, message, gathered, work)

    def finish(self, flight: Flight, wait: bool = True) -> torch.Tensor:
        """The peers' mean of the exchanged values (``wait=False`` is the test-only broken variant that reads
        the peers' messages before the work completes)."""
        if wait:
            flight.work.wait()
        if flight.slice:
            return self._second_stage(flight)
        total = None
        for m in flight.gathered:  # peer order: the same sum on every peer
            value = m if self.codec is None else self.codec.decode(m, flight.numel)
            total = value.clone() if total is None else total.add_(value)
        return total.div_(self.num_nodes)

    def _second_stage(self, flight: Flight) -> torch.Tensor:
        """Average this rank's slice over the peers (peer order, as :meth:`finish` sums), all-gather the slices."""
        n, width = self.num_nodes, flight.slice
        mine = mean_in_peer_order(flight.gathered[0].view(n, width).unbind(0), n)  # fp32 messages: their own adds
        return all_gather_slices(mine, n, self.group).narrow(0, 0, flight.numel)

    def average(self, delta: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """Encode, exchange and average at once (blocking)."""
        return self.finish(self.start(self.encode(delta, residual), delta.numel()))
