"""Exact evaluation under ``fcdp.param_compression``: :func:`exact_gathers`.

[Note: exact gathers]
With ``param_compression`` on, every two-stage gather of a parameter with a valid reference moves a quantized
delta between nodes, so eval forwards and ``generate`` compute with reconstructions of the weights, as training
does. ``exact_gathers(engine)`` is the switch for evaluation: inside it, every gather of the engine crosses
exactly: what each rank computes with is the engine's real 16-bit partitions (``ds_tensor``), gathered as
plain ZeRO-3 gathers them, bit for bit the values ZeRO-3 computes with from the same weights. Nothing of
training's state changes:

- the fp32 master weights and the 16-bit partitions are only read (``refresh_fp32_params``, the old way to force
  exact gathers, also rewrote the master weights from the 16-bit ones);
- references are neither read nor written: an exact stage 1 inside does not seed them
  (``ParamCompression.exact_only``), so the next training gather sends the same delta against the same reference
  as without the evaluation;
- cached slices and gathered parameters that hold reconstructions are dropped on entry (so the evaluation misses
  and gathers exactly), and those holding the exact values are dropped on exit (so training does not compute with
  values it would not have had): both are node-local, no collective.

Between optimizer steps (where an evaluation loop runs) the step already dropped every trainable slice, so a
training run with evaluations inside ``exact_gathers`` is bit for bit the run without them
(``tests/test_compress_params.py``). Inside an accumulation window the window's next micro-step gathers again,
compressed against the unchanged reference, where it would have hit the cache: within the codec's bound, not bit
for bit. Every rank must enter and leave together (gathers are collective, as outside). Without
``param_compression`` (or without ``fcdp``) it changes nothing: gathers are exact anyway.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

#: The invalidation reason of the slices dropped on entry and exit (``get_stats()["invalidations"]``).
REASON = "exact_gathers"


def _partition_all(optimizer: Any) -> None:
    """Release every gathered parameter (DeepSpeed's own, as its checkpoint prologue does); local."""
    partition = getattr(optimizer, "_partition_all_parameters", None)
    if partition is not None:
        partition()


@contextlib.contextmanager
def exact_gathers(engine: Any) -> Iterator[None]:
    """Run the block with exact parameter gathers, leaving master weights and references untouched
    ([Note: exact gathers]). ``engine``: what ``deepspeed.initialize`` returned (or its optimizer's owner)."""
    optimizer = getattr(engine, "optimizer", None)
    runtime = getattr(optimizer, "fcdp", None)
    compression = getattr(runtime, "compression", None)
    if compression is None or compression.exact_only:  # off, or already inside: nothing to switch
        yield
        return
    lossy = [ref.param for ref in compression.store.refs.values()]
    _partition_all(optimizer)
    runtime.invalidate_params(lossy, REASON)
    compression.exact_only = True
    try:
        yield
    finally:
        compression.exact_only = False
        _partition_all(optimizer)
        runtime.invalidate_params(lossy, REASON)
