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

The average is taken in chunks of at most :data:`CHUNK` elements (``all_gather`` of N chunks at a time, the sum in
fp32 in peer order), so its accelerator memory is bounded whatever the model. The gradients are stage 3's flat
partition buffer, on the accelerator: ``offload_optimizer``, whose step takes the gradient norms in the backward
(before the average) and keeps its gradients in host memory, is refused with a warm-up (``config/diloco.py``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from deepspeed import comm as dist

#: Elements averaged per collective: 16 Mi elements (64 MB in fp32) per message.
CHUNK = 1 << 24


@torch.no_grad()
def average_over_peers_(flats: Sequence[torch.Tensor], peer_group: Any, num_nodes: int) -> int:
    """Every tensor of ``flats`` (1-D, on the accelerator) := its mean over the ``num_nodes`` peers, summed in fp32
    in peer order; the same values on every peer. Blocking. Returns the bytes this rank sent."""
    sent = 0
    for flat in flats:
        for start in range(0, flat.numel(), CHUNK):
            piece = flat.narrow(0, start, min(CHUNK, flat.numel() - start))
            gathered = [torch.empty_like(piece) for _ in range(num_nodes)]
            dist.all_gather(gathered, piece, group=peer_group)
            sent += piece.numel() * piece.element_size()
            total = gathered[0].float()  # a copy unless fp32: then summed in place into the gathered buffer
            for m in gathered[1:]:
                total.add_(m.float())
            piece.copy_(total.div_(num_nodes))
    return sent
