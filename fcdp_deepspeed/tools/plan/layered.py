"""``fcdp plan``'s activation rows: the layer-boundary activations per rank that ``fcdp.layered`` keeps, against the
same window accumulated micro-step by micro-step with per-layer activation checkpointing.

Checkpointing each layer keeps its input, ``seq x hidden`` values per example, for the backward; the inside of one
layer is rebuilt for one micro-batch (or one chunk) at a time. Accumulating, a micro-step holds one micro-batch's
boundaries; layered, the step holds the whole window's (every chunk passes a layer before the next layer runs).
Measured per layer on the CPU (``fcdp_lab/activation_memory.py``, ``tests/test_layered.py``): equal to this figure on
a Hugging Face Llama. Not counted here: the inside of one layer for one chunk during its recomputation, the
embedding's output and the head's logits, which a layered step holds for the whole window too.
"""
from __future__ import annotations

from typing import Optional


def activation_plan(layers: int, hidden: int, seq: int, batch: int, chunks: int, dtype_bytes: int) -> dict:
    """Boundary bytes per rank: ``batch`` examples per optimizer step in ``chunks`` chunks (or micro-steps)."""
    per_example = layers * seq * hidden * dtype_bytes
    return {"chunks": chunks, "layers": layers, "batch": batch,
            "boundary_bytes_per_layer_layered": batch * seq * hidden * dtype_bytes,
            "boundary_bytes_layered": batch * per_example,
            "boundary_bytes_accumulated": batch * per_example / chunks}


def format_activations(result: Optional[dict]) -> list[str]:
    if not result:
        return []
    mib = 2 ** 20
    return ["", f"activations (layer boundaries kept for the backward, per rank): {result['batch']} examples per step "
                f"in {result['chunks']} chunks over {result['layers']} layers: layered (fcdp.layered) "
                f"{result['boundary_bytes_layered'] / mib:.1f} MiB, accumulated with per-layer checkpointing "
                f"{result['boundary_bytes_accumulated'] / mib:.1f} MiB (plus one layer's inside for one chunk, the "
                f"embedding output and the logits)"]
