"""The codec of the opt-in lossy compression of the slow inter-node hop (``fcdp.param_compression``,
``fcdp.grad_compression``), and the checkpoint envelope the compressed paths save into.

A leaf: ``quant.py`` (the blockwise codec: quantize/dequantize with torch ops on the accelerator, the wire
format, the test-only codecs), ``native.py`` + ``native_codec.c`` (the same codec as a fused C kernel for CPU
tensors), ``state.py`` (the ``fcdp_compression`` envelope each path registers its part in). The paths that apply
the codec live with the data they move, so each path's walk stays in its own room: the parameter path's
compressed stage 1 and references in ``runtime/compressed_gather.py`` and ``runtime/compression_reference.py``,
the gradient path's compressed inter-node stage and residuals in ``grads/compressed.py`` and ``grads/residual.py``.

[Note: what stays exact] Only the inter-node stage of the two-stage parameter gather and of the
hierarchical gradient reduce-scatter is compressed; intra-node stages, optimizer master weights,
cache hits and every first gather after an invalidation are exact. The defaults (``"off"``) are
bit-identical to the exact paths.
"""
from __future__ import annotations

from fcdp_deepspeed.compress.quant import (CODECS, BlockCodec, Codec, IdentityCodec, codec_for, wire_bytes)

__all__ = ["CODECS", "BlockCodec", "Codec", "IdentityCodec", "codec_for", "wire_bytes"]
