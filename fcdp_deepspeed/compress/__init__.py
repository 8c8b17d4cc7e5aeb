"""Opt-in lossy compression of the slow inter-node hop only (``fcdp.param_compression``,
``fcdp.grad_compression``).

One concern per module: ``quant.py`` (the blockwise codec: quantize/dequantize with torch ops on the
accelerator, the wire format, the test-only codecs); the parameter path: ``reference.py`` (the reference
store every node holds, its states and checkpoint part) and ``params.py`` (the compressed stage 1 of the
two-stage gather, the drift); ``state.py`` (the checkpoint envelope both paths save into). The gradient
path (error-feedback residuals) builds on the same codec.

[Note: what stays exact] Only the inter-node stage of the two-stage parameter gather and of the
hierarchical gradient reduce-scatter is compressed; intra-node stages, optimizer master weights,
cache hits and every first gather after an invalidation are exact. The defaults (``"off"``) are
bit-identical to the exact paths.
"""
from __future__ import annotations

from fcdp_deepspeed.compress.quant import (CODECS, BlockCodec, Codec, IdentityCodec, codec_for, wire_bytes)

__all__ = ["CODECS", "BlockCodec", "Codec", "IdentityCodec", "codec_for", "wire_bytes"]
