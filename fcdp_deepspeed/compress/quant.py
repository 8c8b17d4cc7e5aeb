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
stream: no host synchronization, no host reads. On a CPU device the same arithmetic runs in a fused C kernel
where it builds ([Note: the fused CPU codec] in ``native.py``): the same bytes and bits, a few times faster.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch

from fcdp_deepspeed.compress import native
from fcdp_deepspeed.config import DEFAULT_BLOCK  # elements per scale block: fcdp.compression_block's default
from fcdp_deepspeed.machine import device

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


#: fp32's largest finite value (the rotation's range guard, [Note: butterfly range]).
_FMAX = torch.finfo(torch.float32).max


def _butterflies(y: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """The unnormalized butterfly stages over the *first* dimension of contiguous ``(B, M)`` ``y`` (a block per
    column, [Note: blocks as columns]), ping-ponging between ``y`` and ``work`` (both overwritten): returns whichever
    holds the result.

    [Note: vectorised codec] Each stage writes its sums and differences straight into the other buffer (``out=``):
    the same fp32 adds and subtracts, on the same operands, in the same stage order as the stacked form before
    (``torch.stack((low + high, low - high))``), so the same bits, without a temporary and a copy per stage."""
    src, dst, h, width, cols = y, work, 1, y.shape[0], y.shape[1]
    while h < width:
        s, d = src.view(-1, 2, h * cols), dst.view(-1, 2, h * cols)
        torch.add(s[:, 0], s[:, 1], out=d[:, 0])
        torch.sub(s[:, 0], s[:, 1], out=d[:, 1])
        src, dst, h = dst, src, h * 2
    return src


def _absmax(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """``blocks.abs().amax(dim)``, bit for bit, without the full-size ``abs``: the larger of the block's largest
    value and its smallest value negated (``abs_`` turns a ``-0.0`` of an all-zero block into ``0.0``; NaN and
    inf propagate as through ``amax``)."""
    return torch.maximum(blocks.amax(dim=dim), blocks.amin(dim=dim).neg_()).abs_()


def _guard(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """Per block (along ``dim``): ``2^-log2(B)`` where its values could overflow the butterflies, else 1 ([Note:
    butterfly range])."""
    width = blocks.shape[dim]
    big = _absmax(blocks, dim) > _FMAX / width
    one = torch.ones_like(big, dtype=blocks.dtype)
    return torch.where(big, one * 2.0 ** -(width.bit_length() - 1), one)


def _rotate_columns_(y: torch.Tensor, down: torch.Tensor, scaled: bool = True) -> torch.Tensor:
    """The rotation of every column of contiguous fp32 ``(B, M)`` ``y``, already multiplied by its guard ``down``
    (``(M,)``), overwriting it ([Note: blocks as columns]). Returns the ``(B, M)`` result, finished by
    ``* B^-1/2 * down^-1`` unless ``scaled`` is false (the caller then applies both, in that order)."""
    y = _butterflies(y, torch.empty_like(y))
    return y.mul_(y.shape[0] ** -0.5).mul_(down.reciprocal()) if scaled else y


def _columns(blocks: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``(M, B)`` ``blocks`` (any strides) as contiguous ``(B, M)``, times ``down`` per block: one transposing copy."""
    out = torch.empty(blocks.shape[1], blocks.shape[0], dtype=torch.float32, device=blocks.device)
    return torch.mul(blocks.t(), down, out=out)


def _rows(y: torch.Tensor, down: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Finish a rotation (``y * B^-1/2 * down^-1``, :func:`_rotate_columns_` with ``scaled=False``) while copying
    the ``(B, M)`` columns back to ``(M, B)`` rows in ``out``: the first multiplication is the transposing copy."""
    torch.mul(y.t(), y.shape[0] ** -0.5, out=out)
    return out.mul_(down.reciprocal().unsqueeze(1))


def hadamard_(blocks: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row of ``(M, B)`` fp32 ``blocks`` (``B`` a power of two),
    by butterflies: its own inverse (see [Note: the rotation]). Returns a new tensor.

    [Note: butterfly range] The unnormalized butterflies grow a row by up to ``B`` before the final ``B^-1/2``, so a
    finite row above ``fp32 max / B`` (~2.7e36 at B = 128) would overflow to inf (NaN after ``inf - inf``). Such
    rows are scaled by ``2^-log2(B)`` first and back by ``2^log2(B)`` after: powers of two, exact, so every other
    row gets the same bits as without the guard (no host read: a per-row ``where``).

    [Note: blocks as columns] A butterfly stage pairs elements ``h`` apart inside each block. With a block per row
    the early stages (``h`` = 1, 2, 4, 8) are strided element pairs that the CPU does not vectorise: they took 6.3
    of the 8.1 ms of a 1.3M-element rotation (one thread, measured). With a block per column every stage pairs
    contiguous runs of ``h * M`` elements (2.6 ms), for a transposing copy in (fused with the guard's scaling) and
    one out (fused with the final scaling, or the quantization reads the columns where they are). Every element is
    the same fp32 op on the same operands in the same order as the row form, so the bits are its bits
    (``tests/codec_reference.py``)."""
    blocks = blocks.to(torch.float32)
    down = _guard(blocks, 1)
    y = _rotate_columns_(_columns(blocks, down), down, scaled=False)
    return _rows(y, down, torch.empty_like(blocks, memory_format=torch.contiguous_format))


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class BlockCodec(Codec):
    """Blockwise absmax int8/int4 (see [Note: the wire format]), optionally rotated ([Note: the rotation]).

    [Note: vectorised codec] Every message of a collective is one ``encode_rows``/``decode_rows`` call: all blocks
    of all rows batched, a fixed number of whole-tensor torch ops per call (no loop over rows, blocks or
    parameters). Each op is the one the per-row form used, or one that gives the same bits by construction: a
    block's ``absmax`` is finite exactly when all its elements are (``amax`` propagates NaN and inf); after
    ``clamp`` the only non-finite code is NaN, which ``nan_to_num_`` zeroes as ``where(isfinite)`` did; nibbles
    are packed as ``lo + 16 hi + 136`` in fp32 (exact small integers) and unpacked with uint8 arithmetic
    (``(b & 15) + 248`` wraps to ``lo - 8`` as int8). ``tests/test_compress_codec.py`` compares bytes and
    decoded bits with the per-row reference (``tests/codec_reference.py``) on random and adversarial inputs."""

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

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode_rows(x.reshape(1, -1)).view(-1)

    def decode(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return self.decode_rows(packed.view(1, -1), numel).view(-1)

    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """All rows in one batch ([Note: vectorised codec]); row ``r`` is ``encode(x[r])``'s bytes. On a CPU device
        the fused kernel where it loaded ([Note: the fused CPU codec]), else :meth:`torch_encode_rows`."""
        kernel = kernel_for(x.device)
        if kernel is None:
            return self.torch_encode_rows(x)
        x = x.to(torch.float32)
        x = x if x.stride(1) == 1 else x.contiguous()
        out = torch.empty(x.shape[0], self.wire_numel(x.shape[1]), dtype=torch.uint8)
        return kernel.encode_rows(x, out, self.block, self.bits, self.rotate)

    def decode_rows(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """All rows in one batch ([Note: vectorised codec]); row ``r`` is ``decode(packed[r], numel)``'s bits. On a
        CPU device the fused kernel where it loaded, else :meth:`torch_decode_rows`."""
        kernel = kernel_for(packed.device)
        if kernel is None:
            return self.torch_decode_rows(packed, numel)
        packed = packed if packed.stride(1) == 1 else packed.contiguous()
        out = torch.empty(packed.shape[0], self.blocks(numel) * self.block, dtype=torch.float32)
        return kernel.decode_rows(packed, numel, out, self.block, self.bits, self.rotate).narrow(1, 0, numel)

    def torch_encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`encode_rows` in torch ops, on any device. Rotated blocks are quantized as columns, where the
        rotation leaves them ([Note: blocks as columns])."""
        rows, n = x.shape
        nb, width = self.blocks(n), self.block
        flat, owned = x.to(torch.float32), x.dtype != torch.float32
        if n != nb * width:
            flat, owned = torch.cat([flat, flat.new_zeros(rows, nb * width - n)], dim=1), True
        blocks = flat.reshape(rows * nb, width)
        owned = owned or blocks.data_ptr() != x.data_ptr()
        dim = 1  # the dimension along which a block runs
        if self.rotate:
            down = _guard(blocks, 1)
            blocks, owned, dim = _rotate_columns_(_columns(blocks, down), down), True, 0
        absmax = _absmax(blocks, dim)
        scale = absmax / self.qmax
        scale = torch.where(torch.isfinite(absmax), scale, torch.full_like(scale, float("nan")))
        safe = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
        codes = torch.div(blocks, safe.unsqueeze(dim), out=blocks if owned else None)
        codes.round_().clamp_(-self.qmax, self.qmax).nan_to_num_(0.0)
        codes = codes if dim == 1 else codes.t()  # (M, B): a view of the columns
        head = nb * SCALE_BYTES
        out = torch.empty(rows, head + self.code_bytes(n), dtype=torch.uint8, device=x.device)
        out[:, :head].copy_(scale.view(torch.uint8).view(rows, head))
        payload = out[:, head:]
        if self.bits == 8:
            payload.view(torch.int8).view(rows, nb, width).copy_(codes.reshape(rows, nb, width))
        else:
            pairs = codes.reshape(rows, nb, width // 2, 2)
            packed = torch.add(pairs[..., 0], pairs[..., 1], alpha=16).add_(136)  # (lo + 8) | (hi + 8) << 4
            payload.view(rows, nb, width // 2).copy_(packed)
        return out

    def torch_decode_rows(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """:meth:`decode_rows` in torch ops, on any device. Rotated blocks are unpacked as columns and rotated there
        ([Note: blocks as columns])."""
        rows = packed.shape[0]
        nb, width = self.blocks(numel), self.block
        head = nb * SCALE_BYTES
        heads = packed[:, :head].reshape(-1)  # a copy unless one row
        if heads.storage_offset() % SCALE_BYTES:
            heads = heads.clone()
        scale = heads.view(torch.float32)
        payload = packed[:, head:]
        out = torch.empty(rows, nb * width, dtype=torch.float32, device=packed.device)
        if self.rotate:  # the codes as columns, (B, M), seen as (rows, blocks, B)
            columns = torch.empty(width, rows * nb, dtype=torch.float32, device=packed.device)
            values = columns.t().unflatten(0, (rows, nb))
        else:
            values = out.view(rows, nb, width)
        if self.bits == 8:
            values.copy_(payload.view(torch.int8).view(rows, nb, width))
        else:
            nibbles = values.unflatten(2, (width // 2, 2))
            for i, nibble in enumerate((payload & 0x0F, payload >> 4)):  # lo - 8, hi - 8, wrapped in uint8
                nibbles[..., i].copy_(nibble.add_(248).view(torch.int8).view(rows, nb, width // 2))
        if not self.rotate:
            out.view(rows * nb, width).mul_(scale.unsqueeze(1))
            return out.narrow(1, 0, numel)
        columns.mul_(scale)
        down = _guard(columns, 0)
        y = _rotate_columns_(columns.mul_(down), down, scaled=False)
        return _rows(y, down, out.view(rows * nb, width)).view(rows, nb * width).narrow(1, 0, numel)


logger = logging.getLogger(__name__)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of an fp32 tensor (NaN payloads and the sign of zero included), to compare bit for bit."""
    return t.contiguous().view(torch.int32)


def exact_ties(n: int, qmax: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` fp32 values whose every quotient by their block's scale (7: ``absmax`` ``7 * qmax`` every 8th element)
    is a half-integer: round-half-to-even decides each code, and a multiplication by ``1/7`` instead of the division
    moves some of them off the tie."""
    x = (torch.randint(-qmax, qmax, (n,), generator=gen).float() + 0.5) * 7
    x[::8] = 7.0 * qmax
    return x


def check_rows(block: int, gen: torch.Generator) -> torch.Tensor:
    """Three fp32 rows of ``5 * block + 3`` values (a padded tail) holding what differs first when two codecs'
    arithmetic does: heavy tails, exact round-half ties of int4 and int8 codes, NaN and +-inf blocks, a block of
    signed zeros, a subnormal, a block past the rotation's range guard ([Note: butterfly range])."""
    x = torch.randn(3, 5 * block + 3, generator=gen) * torch.where(
        torch.rand(3, 5 * block + 3, generator=gen) < 0.05, 50.0, 1.0)
    for b, q in ((0, 7), (1, 127)):  # exact ties of int4 and int8 codes at a scale of 7 (1/7 is inexact)
        x[0, b * block:(b + 1) * block] = exact_ties(block, q, gen)
    x[0, 2 * block + 1], x[1, block + 2], x[1, 2 * block] = float("nan"), float("inf"), 1e-40
    x[1, block + 3] = float("-inf")
    x[1, 3 * block:4 * block] = -0.0
    x[2, : block] *= 1e37
    return x


def kernel_agrees(kernel: native.Kernel) -> bool:
    """Whether ``kernel`` gives the torch ops' bytes and decoded bits ([Note: the fused CPU codec]) on
    :func:`check_rows`, for each codec shape the config can select (a power-of-two block, rotated int4 included,
    and an odd one)."""
    gen = torch.Generator().manual_seed(31)
    for block in (128, 8, 10):
        x = check_rows(block, gen)
        shapes = [(8, False), (4, False)] + ([(4, True)] if is_power_of_two(block) else [])
        for bits, rotate in shapes:
            codec = BlockCodec(f"int{bits}", block, bits=bits, rotate=rotate)
            want = codec.torch_encode_rows(x)
            got = kernel.encode_rows(x, torch.empty_like(want), block, bits, rotate)
            out = torch.empty(3, codec.blocks(x.shape[1]) * block)
            decoded = kernel.decode_rows(want, x.shape[1], out, block, bits, rotate).narrow(1, 0, x.shape[1])
            if not (torch.equal(got, want) and torch.equal(bits_of(decoded), bits_of(codec.torch_decode_rows(want, x.shape[1])))):
                return False
    return True


@functools.lru_cache(maxsize=None)
def cpu_kernel() -> Optional[native.Kernel]:
    """The fused CPU codec for this process once it has agreed with the torch ops, else ``None`` (with a warning;
    ``FCDP_CODEC_KERNEL=native`` raises instead)."""
    kernel = native.load()
    if kernel is None or kernel_agrees(kernel):
        return kernel
    if native.mode() == "native":
        raise RuntimeError(f"FCDP_CODEC_KERNEL=native: the fused CPU codec ({kernel.path}) differs from the torch ops "
                           "on the check's rows; set FCDP_CODEC_KERNEL=auto to use the torch ops")
    logger.warning("[fcdp] the fused CPU codec (%s) differs from the torch ops on the check's rows: using the torch "
                   "ops (same bits as every other rank, slower)", kernel.path)
    return None


def kernel_for(where: torch.device) -> Optional[native.Kernel]:
    """The fused CPU codec for tensors on ``where`` if that is a real CPU device, else ``None`` (the torch ops).
    [Note: the kernel and strict mode] Strict device mode models an accelerator on the CPU: its stream model sees
    the reads and writes of torch ops, not those of a foreign kernel, and on an accelerator the codec runs in torch
    ops anyway; so under the strict door the torch ops run (same bits) and every codec access stays visible."""
    return cpu_kernel() if torch.device(where).type == "cpu" and not device.current().strict else None


def ready(codec: Optional[Codec], where: torch.device) -> Optional[Codec]:
    """``codec``, with the fused CPU kernel built and checked now if it will run on CPU tensors at ``where``.
    [Note: the kernel's check at build] Engines call this where they build a codec: the check (:func:`kernel_agrees`)
    reads values on the host, which strict mode rightly counts as a host wait inside a step, and a first build
    takes the compiler's time; at engine build both cost nothing a step sees."""
    if isinstance(codec, BlockCodec):
        kernel_for(where)
    return codec


@dataclass(frozen=True)
class CastCodec(Codec):
    """A plain cast to :attr:`wire_dtype` on the wire (no scales, no blocks): decode is the cast back to fp32."""

    wire_dtype: ClassVar[torch.dtype] = torch.float32

    def wire_numel(self, numel: int) -> int:
        return numel * self.wire_dtype.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1).to(self.wire_dtype).contiguous().view(torch.uint8)

    def decode(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return packed.view(self.wire_dtype).narrow(0, 0, numel).to(torch.float32, copy=True)

    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.wire_dtype).contiguous().view(torch.uint8)

    def decode_rows(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return packed.contiguous().view(self.wire_dtype).narrow(1, 0, numel).to(torch.float32, copy=True)


@dataclass(frozen=True)
class IdentityCodec(CastCodec):
    """Test-only: sends fp32 values unchanged (the scale/permutation guard: compressed paths must then
    equal the exact ones). Never selectable from the config."""


@dataclass(frozen=True)
class Bf16Codec(CastCodec):
    """bf16 on the wire (``fcdp.diloco.compression: bf16`` only): 2 bytes per element, rounded to nearest even.
    [Note: bf16 pseudo-gradients] DiLoCo's outer state is fp32, so an uncompressed pseudo-gradient crosses at
    4 bytes per element: twice the bytes per element of a bf16 job's exact bound (0.199x of it at H = 10, measured).
    bf16 halves that with fp32's range; with the exchange's error feedback what rounding drops is sent at the next
    sync. The cast is elementwise and deterministic, so every peer decodes the same values."""

    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16


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
    if name == "bf16":  # DiLoCo's pseudo-gradients only ([Note: bf16 pseudo-gradients])
        return Bf16Codec(name, block)
    raise ValueError(f"unknown codec {name!r}; expected one of off, {', '.join(CODECS)}")


def wire_bytes(name: str, numel: int, block: int = DEFAULT_BLOCK, dtype_bytes: int = 4) -> int:
    """Bytes one message of ``numel`` values costs on the wire with codec ``name`` (``off``: the exact
    ``numel * dtype_bytes``), from the codec itself: what ``fcdp plan``'s torch-free arithmetic
    (``tools/plan/compression.py``) is checked against."""
    codec = codec_for(name, block)
    return numel * dtype_bytes if codec is None else codec.wire_numel(numel)
