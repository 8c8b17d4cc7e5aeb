"""The codec as it was before it was vectorised (issue 31), kept verbatim as the reference the vectorised codec in
``fcdp_deepspeed/compress/quant.py`` must match byte for byte and bit for bit (``tests/test_compress_codec.py``,
[Note: vectorised codec]). Test-only: nothing in the package imports it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fcdp_deepspeed.compress.quant import SCALE_BYTES, Codec


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
class ReferenceBlockCodec(Codec):
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


def reference_read(store, ds_id: int, shape: tuple[int, int], loss_scale: float):
    """``ResidualStore.read`` before the batched reads (a device store)."""
    first = ds_id not in store.pending
    recorded = store.scales.get(ds_id) if first else store.pending[ds_id]
    index = store.committed.get(ds_id, 0) ^ (0 if first else 1)
    if recorded is None:
        return None
    residual = store._slot(ds_id, index).view(shape)
    return residual * (loss_scale / recorded) if loss_scale != recorded else residual


def reference_exchange(codec, store, clips: dict, me: int, nodes: int, node_sums, ds_ids, scale: float, recv):
    """``GradCompressor._exchange`` before it was vectorised, with ``recv`` standing for what the all-to-all
    delivers: ``(packed, sent residual rows, total)``; writes the new residuals into ``store`` as it did."""
    sizes = [t.shape[1] for t in node_sums]
    x = torch.cat([t.to(torch.float32) for t in node_sums], dim=1)
    offset = 0
    for ds_id, p in zip(ds_ids, sizes):
        first = ds_id not in store.pending
        residual = reference_read(store, ds_id, (nodes - 1, p), scale)
        if residual is not None:
            if first and ds_id in clips:
                residual = residual * clips[ds_id]
            x[:me, offset:offset + p].add_(residual[:me])
            x[me + 1:, offset:offset + p].add_(residual[me:])
        offset += p
    packed = codec.encode_rows(x)
    left = x - codec.decode_rows(packed, x.shape[1])
    sent = torch.cat([left[:me], left[me + 1:]])
    offset = 0
    for ds_id, p in zip(ds_ids, sizes):
        index = store.committed.get(ds_id, 0) ^ 1
        store.pending[ds_id] = scale
        store._slot(ds_id, index).view(sent[:, offset:offset + p].shape).copy_(sent[:, offset:offset + p])
        offset += p
    rows = codec.decode_rows(recv, left.shape[1])
    rows[me] = x[me]
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return packed, sent, total


def reference_stage1(codec, refs: list, sizes: list, valid: list, rows: torch.Tensor, me: int, peers: list):
    """``ParamCompression._stage1`` before it was vectorised, for ``refs`` (each ``(N, p)`` on the accelerator) and a
    bundle ``rows`` (``(N, part)``, this rank's row holding its exact partitions; written in place), with ``peers``
    standing for what the all-gather delivers (``peers[me]`` is replaced by this rank's message). Returns this rank's
    message, the per-parameter drift ``(errors, norms)`` and the new references ``rows[:, off:off + size]``."""
    nodes = rows.shape[0]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    pads = [-(-n // codec.block) * codec.block for n in sizes]
    pad_offsets = [sum(pads[:i]) for i in range(len(pads))]
    total = sum(pads)
    delta = torch.zeros(total, dtype=torch.float32)
    for ref_rows, off, poff, n in zip(refs, offsets, pad_offsets, valid):
        seg = delta.narrow(0, poff, n)
        seg.copy_(rows[me].narrow(0, off, n))
        seg.sub_(ref_rows[me].narrow(0, 0, n))
    own = codec.encode(delta)
    messages = [own if q == me else peers[q] for q in range(nodes)]
    errors, norms = [], []
    for peer in range(nodes):
        decoded = codec.decode(messages[peer].clone(), total)
        for ref_rows, off, poff, size, n in zip(refs, offsets, pad_offsets, sizes, valid):
            recon = torch.add(ref_rows[peer], decoded.narrow(0, poff, size)).to(rows.dtype)
            if peer == me:
                exact = rows[me].narrow(0, off, n).float()
                errors.append(torch.linalg.vector_norm(recon.narrow(0, 0, n).float() - exact))
                norms.append(torch.linalg.vector_norm(exact))
            rows[peer].narrow(0, off, size).copy_(recon)
    return own, (torch.stack(errors), torch.stack(norms)), [rows[:, o:o + s].clone() for o, s in zip(offsets, sizes)]
