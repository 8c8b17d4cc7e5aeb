"""DiLoCo's warm-up (``fcdp.diloco.warmup_steps``): exact data parallelism across the nodes for the first steps.

[Note: the warm-up] For the first ``warmup_steps`` optimizer steps, before DeepSpeed's step reads them, each
rank's reduced gradient partitions (already averaged over its node by stage 3) are averaged with its node peers'
(the ranks at the same node position hold the same partition of the same parameters), so the optimizer steps on
the mean gradient of the whole world, the gradient-norm clipping and the overflow check included: every node takes
bitwise the same step (a fixed-order average, [Note: a fixed-order average] in ``diloco/exchange.py``; the
same inputs on every node give the same Adam state). That is exact data parallelism up to the summation order of
the gradient (node first, then nodes), as ``grad_reduce: hierarchical`` sums. After the last warm-up step the outer
parameters are set from the (equal) fp32 masters, and the sync schedule counts from there. DiLoCo starts from a
model pretrained with data parallelism (arXiv 2311.08105); local SGD after a synchronous phase is post-local SGD
(arXiv 1808.07217). fp16: the averaged gradients are equal on every node, so every node's overflow check and loss
scaler agree during the warm-up.

The average is taken in chunks of at most :data:`CHUNK` elements (on 2 nodes an ``all_gather`` of the 2 chunks, the
sum in fp32 in peer order; on more, the same values in two stages at the bound's bytes, [Note: the warm-up in two
stages]), so its accelerator memory is bounded whatever the model. The gradients are stage 3's flat
partition buffer, on the accelerator: ``offload_optimizer``, whose step takes the gradient norms in the backward
(before the average) and keeps its gradients in host memory, is refused with a warm-up (``config/diloco.py``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.diloco.exchange import all_gather_slices, mean_in_peer_order, padded_slices

#: Elements averaged per collective: 16 Mi elements (64 MB in fp32) per message.
CHUNK = 1 << 24


@torch.no_grad()
def average_over_peers_(flats: Sequence[torch.Tensor], peer_group: Any, num_nodes: int,
                        two_stage: Optional[bool] = None) -> int:
    """Every tensor of ``flats`` (1-D, on the accelerator) := its mean over the ``num_nodes`` peers, summed in fp32
    in peer order; the same values on every peer. Blocking. Returns the bytes this rank sent (gloo's ring, counted
    as the pseudo-gradient exchange counts them): on 2 nodes its piece to the other peer per all-gather; on more,
    two stages ([Note: the warm-up in two stages]; ``two_stage``: default ``num_nodes > 2``, ``False`` is the
    all-gather path the tests compare it with)."""
    two_stage = num_nodes > 2 if two_stage is None else two_stage
    sent = 0
    for flat in flats:
        for start in range(0, flat.numel(), CHUNK):
            piece = flat.narrow(0, start, min(CHUNK, flat.numel() - start))
            sent += (_two_stage_ if two_stage else _all_gather_)(piece, peer_group, num_nodes)
    return sent


def _all_gather_(piece: torch.Tensor, peer_group: Any, num_nodes: int) -> int:
    gathered = [torch.empty_like(piece) for _ in range(num_nodes)]
    dist.all_gather(gathered, piece, group=peer_group)
    piece.copy_(mean_in_peer_order(gathered, num_nodes))
    return (num_nodes - 1) * piece.numel() * piece.element_size()


def _two_stage_(piece: torch.Tensor, peer_group: Any, num_nodes: int) -> int:
    """[Note: the warm-up in two stages] On N > 2 nodes the all-gather sends N - 1 pieces per rank, N/2 times exact
    data parallelism's bound. Instead each peer sends the i-th of N equal slices of its piece to peer i (an
    all-to-all), peer i averages the N slices it received by the same formula (fp32, peer order, divided by N, cast
    to the piece's dtype) and the peers all-gather the averaged slices: every element is computed once, by the
    all-gather path's operations in its order, so the result is bitwise that path's, on every peer, at 2 (N - 1) / N
    of a piece per rank (the pseudo-gradient exchange's two stages and helpers, [Note: two stages on more than two
    nodes] in ``exchange.py``)."""
    n, numel = num_nodes, piece.numel()
    send, width = padded_slices(piece, n)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=peer_group)
    mine = mean_in_peer_order(received.view(n, width).unbind(0), n).to(piece.dtype)
    piece.copy_(all_gather_slices(mine, n, peer_group).narrow(0, 0, numel))
    return 2 * (n - 1) * width * piece.element_size()
