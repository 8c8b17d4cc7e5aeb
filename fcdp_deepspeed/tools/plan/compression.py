"""The planner's model of the compressed inter-node hop (``fcdp.param_compression``/``grad_compression``).

One function, :func:`compressed_step`, holds the whole byte and memory model, so it can be checked
against the compressed paths' counters (``tests/test_planner.py``):

- **parameter stage** (stage 1 of the two-stage gather, among node peers): once per optimizer step each
  owner's partition of every changed (trainable) parameter crosses into each other node as one message
  of ``wire_bytes(codec, ceil(numel / W))`` bytes; over the cluster that is ``(N - 1) * W`` messages per
  parameter (exact: ``(N - 1)`` x the parameter's bytes);
- **gradient stage** (the inter-node stage of the hierarchical reduce-scatter): each rank sends its
  node's sum of its chunk to the N - 1 other node peers as ``N - 1`` rows of ``ceil(numel / W)`` values,
  once per optimizer step with ``grad_accumulation: node``;
- **memory**: references (the trainable parameters' stage-1 bundles the deltas are taken against): 1/L
  of the trainable parameters per rank in the parameter dtype; error-feedback residuals:
  :func:`residual_bytes_per_rank`, two fp32 slots (committed and pending) of the N - 1 rows a rank sends
  of every trainable parameter, ``2 x 4 x (N - 1) x ceil(numel / W)`` bytes each, about 8 (N - 1)/W bytes
  per trainable parameter, in every precision (its own row stays exact, [Note: the own row] in
  ``grads/compressed.py``).

Wire bytes per message are :func:`wire_bytes`, the codec's own ``wire_numel``: ``ceil(n / block)`` fp32
scales plus the codes of whole blocks (the last one zero-padded), ``ceil(n / block) * (4 + block)`` for int8
and ``ceil(n / block) * (4 + block / 2)`` for int4. Without per-message sizes (``param_numels``) the trainable parameters are modelled as one tensor,
which undercounts the padding of each message's last block (under ``block`` bytes per message).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

#: The codec's wire format (``compress/quant.py``): one fp32 scale per block, then the codes of whole blocks.
SCALE_BYTES = 4
DEFAULT_BLOCK = 128


def wire_bytes(name: str, numel: int, block: int = DEFAULT_BLOCK, dtype_bytes: int = 4) -> int:
    """Bytes one message of ``numel`` values costs on the wire with codec ``name`` (``off``: ``numel * dtype_bytes``):
    the codec's ``wire_numel`` as pure arithmetic, so ``fcdp plan`` imports neither torch nor DeepSpeed
    (``tests/test_planner.py`` checks it against :func:`fcdp_deepspeed.compress.wire_bytes`)."""
    if name == "off":
        return numel * dtype_bytes
    if name == "bf16":
        return numel * 2
    if name not in ("int8", "int4"):
        raise ValueError(f"unknown codec {name!r}; expected one of off, int8, int4, bf16")
    blocks = max(1, math.ceil(numel / block))
    codes = blocks * block
    return blocks * SCALE_BYTES + (codes if name == "int8" else codes // 2)


#: Bytes per error-feedback residual element (fp32) and slots per parameter: the committed residual and the
#: pending one a window writes, kept in every precision because DeepSpeed skips any step whose gradient norm is not
#: finite ([Note: residual commit] with the residual store, which allocates ``SLOTS x ELEMENT_BYTES`` per element).
RESIDUAL_ELEMENT_BYTES = 4
RESIDUAL_SLOTS = 2


def residual_bytes_per_rank(nodes: int, ranks_per_node: int, numels: Sequence[float]) -> int:
    """Error-feedback residual bytes one rank holds with ``fcdp.grad_compression`` on N nodes x L ranks, for the
    trainable parameters of ``numels`` elements (all of them covered): per parameter, the N - 1 rows it sends
    across nodes of ``ceil(numel / W)`` fp32 elements, in two slots. ``grad_residual_host_bytes`` (or
    ``_device_bytes``) of ``get_stats`` measures the same. 0 on one node or one rank per node."""
    n, w = nodes, nodes * ranks_per_node
    if n <= 1 or ranks_per_node <= 1:
        return 0
    return RESIDUAL_SLOTS * RESIDUAL_ELEMENT_BYTES * sum((n - 1) * math.ceil(int(round(x)) / w) for x in numels)


#: Compression settings the planner shows rows for, as (param_compression, grad_compression).
SETTINGS = (("int8", "off"), ("off", "int8"), ("int8", "int8"), ("int4", "off"), ("off", "int4"), ("int4", "int4"))


def compressed_step(nodes: int, ranks_per_node: int, trainable_numel: float, dtype_bytes: int,
                    param_compression: str = "off", grad_compression: str = "off", block: int = 128,
                    param_numels: Optional[Sequence[int]] = None) -> dict:
    """Inter-node bytes per optimizer step (cluster total: the sum over node uplinks) of the compressed
    stages, and the extra memory per rank, for N nodes x L ranks (see the module doc). ``off`` gives the
    exact stage's bytes, so ``compressed_step(..., "off", "off")`` is ``fcdp_node``'s trainable traffic."""
    n, L = nodes, ranks_per_node
    w = n * L
    sizes = list(param_numels) if param_numels is not None else [int(round(trainable_numel))]
    if n <= 1 or L <= 1 or not sizes or sum(sizes) == 0:
        return {"param_stage_bytes": 0.0, "grad_stage_bytes": 0.0, "total_bytes": 0.0,
                "reference_bytes_per_rank": 0.0, "residual_bytes_per_rank": 0.0, "applies": False}
    messages = (n - 1) * w  # per parameter (or gradient bucket), over the cluster
    param_stage = messages * sum(wire_bytes(param_compression, math.ceil(s / w), block, dtype_bytes) for s in sizes)
    grad_stage = messages * sum(wire_bytes(grad_compression, math.ceil(s / w), block, dtype_bytes) for s in sizes)
    per_rank = sum(sizes) / L
    references = per_rank * dtype_bytes if param_compression != "off" else 0.0
    residuals = residual_bytes_per_rank(n, L, sizes) if grad_compression != "off" else 0.0
    return {"param_stage_bytes": float(param_stage), "grad_stage_bytes": float(grad_stage),
            "total_bytes": float(param_stage + grad_stage), "reference_bytes_per_rank": float(references),
            "residual_bytes_per_rank": float(residuals), "applies": True}
