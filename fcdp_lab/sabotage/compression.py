"""Broken variants of the compression path (registered with :func:`fcdp_lab.sabotage.variant`).

- ``compression.reconstruction``: this process's compressed gathers reconstruct a bundle one ulp off in its first
  element, written into the reference too (``compression.reconstruction@1``: rank 1 only: the replica check's
  variant);
- ``compression.own_row``: the gradient exchange quantizes the own row like the others (``GradCompressor.own_row_exact``);
- ``compression.clip``: residuals are committed without the step's clip coefficient;
- ``compression.share``: a checkpoint load rebuilds each reference bundle from the wrong peers' rows (rolled by one).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from fcdp_lab.sabotage import replace, variant


@variant("compression.reconstruction")
def reconstruction(_: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.compression_reference import ReferenceStore
    original = ReferenceStore.write_many

    def write_many(self: Any, refs: list, values: list, *, lossy: bool) -> None:
        if lossy and values:  # the decode's write: values[0] views the bundle's first element
            bits = {2: torch.int16, 4: torch.int32}[values[0].element_size()]
            values[0].view(bits)[0, 0].bitwise_xor_(1)
        original(self, refs, values, lossy=lossy)
    replace(ReferenceStore, "write_many", write_many)


@variant("compression.own_row")
def own_row(_: Optional[str]) -> None:
    from fcdp_deepspeed.grads.compressed import GradCompressor
    replace(GradCompressor, "own_row_exact", lambda self: False)


@variant("compression.clip")
def clip(_: Optional[str]) -> None:
    from fcdp_deepspeed.grads.compressed import GradCompressor
    original = GradCompressor.commit
    replace(GradCompressor, "commit", lambda self, clip=None: original(self, clip=None))


@variant("compression.share")
def share(_: Optional[str]) -> None:
    from fcdp_deepspeed.runtime.compression_reference import ReferenceCheckpoint
    original = ReferenceCheckpoint._gather_shares
    replace(ReferenceCheckpoint, "_gather_shares",
            lambda self, shares, refs: [bundle.roll(1, dims=0) for bundle in original(self, shares, refs)])
