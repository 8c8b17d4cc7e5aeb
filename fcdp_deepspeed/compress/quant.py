"""Blockwise symmetric quantization: the codec of the compressed inter-node hop.

[Note: the wire format]
A 1-D float tensor of ``n`` elements is cut into ``ceil(n / block)`` blocks (the last one zero-padded).
Each block is sent as one fp32 scale (``absmax / qmax``) and ``block`` signed codes
``clamp(round(x / scale), -qmax, qmax)``: ``int8`` (qmax 127, one byte per code) or ``int4`` (qmax 7,
two codes per byte, each stored as ``code + 8`` in a nibble, low nibble first). The packed buffer is one
``uint8`` tensor, scales first, then codes, of :meth:`Codec.wire_numel` bytes: a fixed size for a given
``n``, so every rank of a collective knows every message's length without a size exchange.

[Note: determinism] Decoding is ``code * scale`` in fp32, elementwise, in one fixed order of torch ops,
and rounding is round-half-to-even (``torch.round``): every rank that decodes the same bytes on the same
kind of device gets the same bits, which is what keeps compressed replicas in lockstep. Nobody decodes
its own *input*: the sender decodes its packed bytes like every receiver (:meth:`Codec.roundtrip`).

[Note: the rotation] ``int4`` rotates each block by the orthonormal Walsh-Hadamard matrix ``H / sqrt(block)``
before quantizing and rotates the decoded block back (``H`` is symmetric and its own inverse up to the
factor): one large element of a block (gradients are heavy-tailed) is spread over the whole block instead of
setting a scale that rounds every other element to zero, so the same 4 bits lose less (SDP4Bit, NeurIPS'24,
rotates its 4-bit gradients the same way). The transform is ``log2(block)`` butterfly stages of elementwise
adds and subtracts in fp32, a fixed order of torch ops like the rest of the codec ([Note: determinism]); it
needs a power-of-two block (``fcdp.compression_block``, refused otherwise for ``int4``). ``int8`` does not
rotate: its error is already ~1/16 of int4's and measured convergence is within noise of exact.

[Note: non-finite blocks] A block holding inf or NaN gets a NaN scale, so it decodes to NaN: an
overflowed fp16 gradient stays an overflow (DeepSpeed's check skips the step), never a silently
clamped value.

Everything runs with torch ops on the input's device (the accelerator on CUDA), on the current
stream: no host synchronization, no host reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

CodecName = Literal["off", "int8", "int4"]
#: ``fcdp.param_compression`` / ``fcdp.grad_compression`` values that compress.
CODECS = ("int8", "int4")
#: fp32 scale per block.
SCALE_BYTES = 4


@dataclass(frozen=True)
class Codec:
    """The codec interface: a fixed-size packed ``uint8`` message per ``numel`` input elements."""

    name: str
    block: int

    def wire_numel(self, numel: int) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """``x`` (1-D, any float dtype) -> packed ``uint8`` of ``wire_numel(x.numel())`` bytes."""
        raise NotImplementedError

    def decode(self, packed: torch.Tensor, numel: int) -> torch.Tensor:  # pragma: no cover - interface
        """Packed bytes -> fp32 tensor of ``numel`` elements."""
        raise NotImplementedError

    def roundtrip(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, decoded)``: what is sent and what every receiver (and the sender) computes with."""
        packed = self.encode(x)
        return packed, self.decode(packed, x.numel())

    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``(R, n)`` -> ``(R, wire_numel(n))`` packed rows, row ``r`` equal to ``encode(x[r])`` (one message per
        row of an all-to-all; blocks never span rows)."""
        return torch.stack([self.encode(row) for row in x])

    def decode_rows(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """``(R, wire_numel(n))`` -> ``(R, n)`` fp32, row ``r`` bitwise equal to ``decode(packed[r], n)``."""
        return torch.stack([self.decode(row, numel) for row in packed])


def hadamard_(blocks: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row of ``(M, B)`` fp32 ``blocks`` (``B`` a power of two),
    by butterflies: its own inverse (see [Note: the rotation]). Returns a new tensor.

    [Note: butterfly range] The unnormalized butterflies grow a row by up to ``B`` before the final ``B^-1/2``, so a
    finite row above ``fp32 max / B`` (~2.7e36 at B = 128) would overflow to inf (NaN after ``inf - inf``). Such
    rows are scaled by ``2^-log2(B)`` first and back by ``2^log2(B)`` after: powers of two, exact, so every other
    row gets the same bits as without the guard (no host read: a per-row ``where``)."""
    rows, width = blocks.shape
    stages = width.bit_length() - 1
    big = blocks.abs().amax(dim=1, keepdim=True) > torch.finfo(torch.float32).max / width
    one = torch.ones_like(big, dtype=blocks.dtype)
    down = torch.where(big, one * 2.0 ** -stages, one)
    y, h = blocks * down, 1
    while h < width:
        pairs = y.reshape(rows, width // (2 * h), 2, h)
        low, high = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack((low + high, low - high), dim=2)
        h *= 2
    return y.reshape(rows, width).mul_(width ** -0.5).mul_(down.reciprocal())


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class BlockCodec(Codec):
    """Blockwise absmax int8/int4 (see [Note: the wire format]), optionally rotated ([Note: the rotation])."""

    bits: int = 8
    rotate: bool = False

    def __post_init__(self) -> None:
        if self.rotate and not is_power_of_two(self.block):
            raise ValueError(f"a rotated codec needs a power-of-two block, not {self.block}")

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def blocks(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.block))

    def code_bytes(self, numel: int) -> int:
        codes = self.blocks(numel) * self.block
        return codes if self.bits == 8 else codes // 2

    def wire_numel(self, numel: int) -> int:
        return self.blocks(numel) * SCALE_BYTES + self.code_bytes(numel)

    def _scales(self, blocks: torch.Tensor) -> torch.Tensor:
        absmax = blocks.abs().amax(dim=1)
        scale = absmax / self.qmax
        finite = torch.isfinite(blocks).all(dim=1)
        return torch.where(finite, scale, torch.full_like(scale, float("nan")))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        nb = self.blocks(n)
        flat = x.reshape(-1).to(torch.float32)
        if flat.numel() != nb * self.block:
            flat = torch.cat([flat, flat.new_zeros(nb * self.block - flat.numel())])
        blocks = flat.view(nb, self.block)
        if self.rotate:
            blocks = hadamard_(blocks)
        scale = self._scales(blocks)
        safe = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
        codes = torch.round(blocks / safe.unsqueeze(1)).clamp_(-self.qmax, self.qmax)
        codes = torch.where(torch.isfinite(codes), codes, torch.zeros_like(codes)).to(torch.int16)
        if self.bits == 8:
            payload = codes.to(torch.int8).view(torch.uint8).reshape(-1)
        else:
            nibbles = (codes + 8).to(torch.uint8).reshape(-1, 2)
            payload = nibbles[:, 0] | (nibbles[:, 1] << 4)
        return torch.cat([scale.view(torch.uint8).reshape(-1), payload])

    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Vectorized :meth:`Codec.encode_rows`: the same ops per row as :meth:`encode`, so the same bytes."""
        rows, n = x.shape
        nb = self.blocks(n)
        flat = x.to(torch.float32)
        if n != nb * self.block:
            flat = torch.cat([flat, flat.new_zeros(rows, nb * self.block - n)], dim=1)
        blocks = flat.reshape(rows * nb, self.block)
        if self.rotate:
            blocks = hadamard_(blocks)
        scale = self._scales(blocks)
        safe = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
        codes = torch.round(blocks / safe.unsqueeze(1)).clamp_(-self.qmax, self.qmax)
        codes = torch.where(torch.isfinite(codes), codes, torch.zeros_like(codes)).to(torch.int16)
        if self.bits == 8:
            payload = codes.to(torch.int8).view(torch.uint8).reshape(rows, -1)
        else:
            nibbles = (codes + 8).to(torch.uint8).reshape(-1, 2)
            payload = (nibbles[:, 0] | (nibbles[:, 1] << 4)).reshape(rows, -1)
        return torch.cat([scale.view(torch.uint8).reshape(rows, -1), payload], dim=1)

    def decode_rows(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """Vectorized :meth:`Codec.decode_rows` (elementwise the same ops as :meth:`decode`)."""
        rows = packed.shape[0]
        nb = self.blocks(numel)
        head = nb * SCALE_BYTES
        scale = packed[:, :head].contiguous().view(torch.float32).reshape(rows * nb)
        payload = packed[:, head:].contiguous()
        if self.bits == 8:
            codes = payload.view(torch.int8).to(torch.float32)
        else:
            low = (payload & 0x0F).to(torch.int16) - 8
            high = (payload >> 4).to(torch.int16) - 8
            codes = torch.stack([low, high], dim=2).reshape(rows, -1).to(torch.float32)
        values = codes.reshape(rows * nb, self.block) * scale.unsqueeze(1)
        if self.rotate:
            values = hadamard_(values)
        return values.reshape(rows, nb * self.block).narrow(1, 0, numel)

    def decode(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        nb = self.blocks(numel)
        head = nb * SCALE_BYTES
        scale = packed.narrow(0, 0, head).view(torch.float32)
        payload = packed.narrow(0, head, packed.numel() - head)
        if self.bits == 8:
            codes = payload.view(torch.int8).to(torch.float32)
        else:
            low = (payload & 0x0F).to(torch.int16) - 8
            high = (payload >> 4).to(torch.int16) - 8
            codes = torch.stack([low, high], dim=1).reshape(-1).to(torch.float32)
        values = codes.view(nb, self.block) * scale.unsqueeze(1)
        if self.rotate:
            values = hadamard_(values)
        return values.reshape(-1).narrow(0, 0, numel)


@dataclass(frozen=True)
class IdentityCodec(Codec):
    """Test-only: sends fp32 values unchanged (the scale/permutation guard: compressed paths must then
    equal the exact ones). Never selectable from the config."""

    def wire_numel(self, numel: int) -> int:
        return numel * 4

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1).to(torch.float32).contiguous().view(torch.uint8)

    def decode(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return packed.view(torch.float32).narrow(0, 0, numel).clone()

    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32).contiguous().view(torch.uint8)

    def decode_rows(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return packed.contiguous().view(torch.float32).narrow(1, 0, numel).clone()


#: Default elements per scale block (``fcdp.compression_block``).
DEFAULT_BLOCK = 128


#: Which side's ``int4`` rotates its blocks ([Note: the rotation]): gradients, whose blocks are heavy-tailed.
ROTATED_INT4 = ("grads",)


def codec_for(name: str, block: int = DEFAULT_BLOCK, side: str = "params") -> Codec | None:
    """The codec for a config value (``None`` for ``"off"``) on ``side`` (``"params"`` or ``"grads"``)."""
    if name == "off":
        return None
    if name == "int8":
        return BlockCodec(name, block, bits=8)
    if name == "int4":
        return BlockCodec(name, block, bits=4, rotate=side in ROTATED_INT4)
    raise ValueError(f"unknown codec {name!r}; expected one of off, {', '.join(CODECS)}")


def wire_bytes(name: str, numel: int, block: int = DEFAULT_BLOCK, dtype_bytes: int = 4) -> int:
    """Bytes one message of ``numel`` values costs on the wire with codec ``name`` (``off``: the exact
    ``numel * dtype_bytes``): the planner's model of the compressed rows."""
    codec = codec_for(name, block)
    return numel * dtype_bytes if codec is None else codec.wire_numel(numel)
