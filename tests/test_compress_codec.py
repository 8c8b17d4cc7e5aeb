"""The blockwise codec of the compressed inter-node hop (``fcdp_deepspeed/compress/quant.py``): wire size,
error bound, determinism, non-finite blocks. Single-process and fast; the distributed paths have their own tests."""
from __future__ import annotations

import pytest
import torch

from fcdp_deepspeed.compress import BlockCodec, IdentityCodec, codec_for, wire_bytes
from fcdp_deepspeed.compress.quant import hadamard_
from fcdp_deepspeed.config import FCDPConfigError, parse_fcdp_config


@pytest.mark.parametrize("name,qmax,per_elem", [("int8", 127, 1.0), ("int4", 7, 0.5)])
@pytest.mark.parametrize("numel", [1, 127, 128, 1000, 4096])
def test_roundtrip_error_is_half_a_step_per_block(name, qmax, per_elem, numel):
    codec = codec_for(name, 128)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    packed, decoded = codec.roundtrip(x)
    assert packed.dtype == torch.uint8 and packed.numel() == codec.wire_numel(numel)
    assert codec.wire_numel(numel) == codec.blocks(numel) * 4 + int(codec.blocks(numel) * 128 * per_elem)
    blocks = torch.nn.functional.pad(x, (0, codec.blocks(numel) * 128 - numel)).view(-1, 128)
    step = (blocks.abs().amax(1) / qmax).repeat_interleave(128)[:numel]
    assert ((decoded - x).abs() <= step / 2 * (1 + 1e-6) + 1e-12).all()


def test_decoding_is_deterministic_and_the_sender_decodes_its_bytes():
    codec = codec_for("int4", 64)
    x = torch.randn(999)
    p1, d1 = codec.roundtrip(x)
    assert torch.equal(d1, codec.decode(p1.clone(), 999))
    assert torch.equal(p1, codec.encode(x.clone()))


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("side", ["params", "grads"])
def test_non_finite_block_decodes_to_nan_and_zero_block_to_zero(name, side):
    codec = codec_for(name, 128, side=side)
    x = torch.randn(384)
    x[130] = float("inf")
    out = codec.decode(codec.encode(x), 384)
    assert torch.isnan(out[128:256]).all() and torch.isfinite(out[:128]).all() and torch.isfinite(out[256:]).all()
    zeros = torch.zeros(200)
    assert torch.equal(codec.decode(codec.encode(zeros), 200), zeros)


def test_identity_codec_is_exact_and_wire_bytes_model():
    ident = IdentityCodec("identity", 128)
    x = torch.randn(77)
    assert torch.equal(ident.decode(ident.encode(x), 77), x)
    assert wire_bytes("off", 1000) == 4000
    assert wire_bytes("int8", 1024) == 8 * 4 + 1024 and wire_bytes("int4", 1024) == 8 * 4 + 512
    assert isinstance(codec_for("int8"), BlockCodec) and codec_for("off") is None


def test_config_keys_default_off_and_odd_block_refused():
    cfg = parse_fcdp_config({"fcdp": {"enabled": True}})
    assert (cfg.param_compression, cfg.grad_compression, cfg.compression_block) == ("off", "off", 128)
    with pytest.raises(FCDPConfigError, match="compression_block = 63"):
        parse_fcdp_config({"fcdp": {"enabled": True, "compression_block": 63}})


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("numel", [1, 100, 128, 1000])
@pytest.mark.parametrize("side", ["params", "grads"])
def test_rows_are_the_single_message_format_and_decode_bitwise_alike(name, numel, side):
    """``encode_rows``/``decode_rows`` (one all-to-all message per row) give each row exactly ``encode``'s bytes and
    ``decode``'s values, non-finite blocks included: the sender's residual and every receiver see the same bits."""
    codec = codec_for(name, 64, side=side)
    x = torch.randn(3, numel, generator=torch.Generator().manual_seed(numel)) * torch.tensor([[1e-3], [1.0], [1e3]])
    x[1, -1] = float("nan")
    packed = codec.encode_rows(x)
    assert packed.shape == (3, codec.wire_numel(numel)) and packed.dtype == torch.uint8
    decoded = codec.decode_rows(packed, numel)
    for r in range(3):
        assert torch.equal(packed[r], codec.encode(x[r]))
        assert torch.equal(decoded[r].nan_to_num(7.0), codec.decode(packed[r], numel).nan_to_num(7.0))
    ident = IdentityCodec("identity", 64)
    assert torch.equal(ident.decode_rows(ident.encode_rows(x), numel).nan_to_num(7.0), x.nan_to_num(7.0))


def test_rotation_is_its_own_inverse_and_spreads_an_outlier():
    """int4 gradients are rotated blockwise (``quant.py``, [Note: the rotation]): the orthonormal Walsh-Hadamard
    transform undoes itself, and on heavy-tailed blocks (a few large elements, as gradients have) the rotated codec
    loses far less than the plain one; on the wire it is the same size."""
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(hadamard_(hadamard_(x)), x, atol=1e-6)
    assert torch.allclose(hadamard_(x).norm(dim=1), x.norm(dim=1), rtol=1e-5)
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(512 * 128, generator=gen) * torch.where(torch.rand(512 * 128, generator=gen) < 0.02, 20.0, 1.0)
    plain, rotated = codec_for("int4", 128, side="params"), codec_for("int4", 128, side="grads")
    assert (plain.rotate, rotated.rotate) == (False, True) and not codec_for("int8", 128, side="grads").rotate
    assert plain.wire_numel(g.numel()) == rotated.wire_numel(g.numel())
    err = {c.rotate: ((c.roundtrip(g)[1] - g).norm() / g.norm()).item() for c in (plain, rotated)}
    assert err[True] < 0.5 * err[False], err


def test_a_rotated_codec_without_its_inverse_fails():
    """The broken variant: decoding a rotated block without rotating it back is far off (the guard above would not
    notice a missing inverse if it only compared wire sizes)."""
    codec = codec_for("int4", 64, side="grads")
    x = torch.randn(640)
    packed = codec.encode(x)
    unrotated = BlockCodec("int4", 64, bits=4).decode(packed, 640)
    assert ((unrotated - x).norm() / x.norm()).item() > 0.5
    assert ((codec.decode(packed, 640) - x).norm() / x.norm()).item() < 0.2


def test_int4_gradients_refuse_a_block_that_is_not_a_power_of_two():
    with pytest.raises(FCDPConfigError, match=r"compression_block = 96 .*Fix: set compression_block to 64 or 128"):
        parse_fcdp_config({"fcdp": {"enabled": True, "grad_compression": "int4", "compression_block": 96}})
    assert parse_fcdp_config({"fcdp": {"enabled": True, "param_compression": "int4", "compression_block": 96}})
    with pytest.raises(ValueError, match="power-of-two block"):
        BlockCodec("int4", 96, bits=4, rotate=True)


def test_rotation_of_a_finite_huge_block_stays_finite_and_other_rows_keep_their_bits():
    """[Note: butterfly range] in quant.py: the unnormalized butterflies grew a finite row above fp32 max / B to
    inf (NaN after the subtraction); a guarded row is scaled by powers of two, so unguarded rows keep their bits."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 128, generator=gen)
    x[1] *= 1e37  # finite, above fp32 max / 128 ~ 2.7e36
    x[2] = 3e38 / 128 ** 0.5 * torch.sign(torch.randn(128, generator=gen))  # near the largest finite rotated norm
    y = hadamard_(x)
    assert torch.isfinite(y).all()
    assert torch.allclose(hadamard_(y)[1:], x[1:], rtol=1e-5)
    assert torch.allclose(y[1:].norm(dim=1), x[1:].norm(dim=1), rtol=1e-5)
    unguarded = x[0].view(1, 128).clone()
    h = 1
    while h < 128:  # the transform without the guard: row 0's bits are unchanged by it
        pairs = unguarded.reshape(1, 128 // (2 * h), 2, h)
        unguarded = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    assert torch.equal(y[0], unguarded.reshape(128) * 128 ** -0.5)
    codec = codec_for("int4", 128, side="grads")
    decoded = codec.roundtrip(x[1])[1]  # 1e37-scale elements through the whole int4 gradient codec
    err = (decoded.double() - x[1].double()).norm() / x[1].double().norm()  # float64: the norms overflow fp32
    assert torch.isfinite(decoded).all() and err.item() < 0.2


# -- the vectorised codec against the per-row codec it replaced ([Note: vectorised codec]) ---------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (NaN payloads and the sign of zero included)."""
    t = t.contiguous()
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _adversarial(gen: torch.Generator, rows: int, n: int, dtype: torch.dtype):
    """Random and adversarial rows: heavy tails, NaN and inf blocks, signed zeros and subnormals, fp32's extremes."""
    x = torch.randn(rows, n, generator=gen)
    yield "randn", x
    yield "heavy tails", x * torch.where(torch.rand(rows, n, generator=gen) < 0.02, 50.0, 1.0)
    y = x.clone()
    y[0, n // 2] = float("nan")
    y[-1, 0], y[-1, -1] = float("inf"), float("-inf")
    yield "nan and inf", y
    z = torch.zeros(rows, n)
    z[0, : n // 3] = -0.0
    z[-1, -1] = 1e-40
    yield "zeros and a subnormal", z
    ties = torch.randint(-20, 20, (rows, n), generator=gen).float() / 2  # round-half-to-even ties
    yield "ties", ties
    if dtype == torch.float32:
        from fcdp_deepspeed.compress.quant import exact_ties
        for q in (7, 127):  # every code a tie of round-half-to-even (int4's, then int8's)
            yield f"exact ties {q}", torch.stack([exact_ties(n, q, gen) for _ in range(rows)])
        yield "huge", x * 1e37  # [Note: butterfly range]
        yield "tiny", x * 1e-41
        m = x.clone()
        m[0] = 3e38
        yield "fp32 max", m


@pytest.mark.parametrize("bits,rotate,block", [(8, False, 128), (4, False, 128), (4, True, 128), (4, True, 16),
                                               (8, False, 10), (4, False, 10), (4, True, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_vectorised_codec_gives_the_per_row_codec_s_bytes_and_bits(bits, rotate, block, dtype):
    """Issue 31: ``encode_rows``/``decode_rows`` batch every block of every row in one call with fused ops; their
    bytes and decoded bits (NaN payloads, signed zeros) equal the codec before it (``tests/codec_reference.py``, its
    per-row ``encode``/``decode``), on padded tails, one and several rows, every dtype."""
    from codec_reference import ReferenceBlockCodec
    name = f"int{bits}"
    new, old = BlockCodec(name, block, bits=bits, rotate=rotate), ReferenceBlockCodec(name, block, bits=bits, rotate=rotate)
    gen = torch.Generator().manual_seed(block * bits)
    for rows in (1, 3):
        for n in (1, block, 3 * block + 5):
            for kind, x in _adversarial(gen, rows, n, dtype):
                x = x.to(dtype)
                want = torch.stack([old.encode(r) for r in x])
                got = new.encode_rows(x)
                assert torch.equal(got, want), (kind, rows, n)
                decoded = torch.stack([old.decode(r.clone(), n) for r in want])  # .clone(): the old decode needs aligned rows
                assert torch.equal(_bits(new.decode_rows(got, n)), _bits(decoded)), (kind, rows, n)
                assert torch.equal(new.encode(x[-1]), want[-1]) and torch.equal(_bits(new.decode(want[-1], n)), _bits(decoded[-1]))
    for x in (torch.randn(2, 4 * block, generator=gen), torch.randn(2, 300, generator=gen)[:, 40:]):
        kept = x.clone()  # a contiguous or strided fp32 input is read, never written (the codec works on its own copy)
        assert torch.equal(new.encode_rows(x), torch.stack([old.encode(r) for r in kept])) and torch.equal(x, kept)


def test_bf16_codec_is_a_deterministic_cast_at_two_bytes():
    """DiLoCo's ``compression: bf16`` ([Note: bf16 pseudo-gradients]): 2 bytes per element, decode(encode(x)) is
    x rounded to bf16 (nearest even), the same bits on every call."""
    from fcdp_deepspeed.compress.quant import Bf16Codec, codec_for, wire_bytes
    codec = codec_for("bf16", 128, side="grads")
    assert isinstance(codec, Bf16Codec) and codec.wire_numel(1000) == 2000 and wire_bytes("bf16", 1000) == 2000
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0)) * 1e3
    packed, decoded = codec.roundtrip(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 2002
    assert torch.equal(decoded, x.to(torch.bfloat16).float()) and torch.equal(codec.decode(packed, 1001), decoded)


# -- the fused CPU codec ([Note: the fused CPU codec] in compress/native.py) -----------------------------------------
@pytest.fixture(scope="module")
def kernel():
    from fcdp_deepspeed.compress import native
    return native.Kernel(native.build())


@pytest.mark.parametrize("bits,rotate,block", [(8, False, 128), (4, False, 128), (4, True, 128), (4, True, 16),
                                               (8, False, 10), (4, False, 10), (4, True, 8), (4, True, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_cpu_codec_gives_the_torch_ops_bytes_and_bits(kernel, monkeypatch, bits, rotate, block, dtype):
    """The C kernel behind ``encode_rows``/``decode_rows`` on CPU tensors: the torch ops' bytes and decoded bits on
    the adversarial rows (NaN payloads and signed zeros included), one row and several, padded tails, strided input
    rows and strided messages (an all-to-all's rows in a larger buffer)."""
    from fcdp_deepspeed.compress import quant
    monkeypatch.setattr(quant, "cpu_kernel", lambda: kernel)
    codec = BlockCodec(f"int{bits}", block, bits=bits, rotate=rotate)
    gen = torch.Generator().manual_seed(block + bits)
    for rows in (1, 3):
        for n in (1, block, 3 * block + 5, 40 * block + 3):
            for kind, x in _adversarial(gen, rows, n, dtype):
                x = x.to(dtype)
                want = codec.torch_encode_rows(x)
                assert torch.equal(codec.encode_rows(x), want), (kind, rows, n)
                assert torch.equal(_bits(codec.decode_rows(want, n)), _bits(codec.torch_decode_rows(want, n))), (kind, rows, n)
    x = torch.randn(2, 9 * block + 40, generator=gen)[:, 40:]  # strided rows
    assert torch.equal(codec.encode_rows(x), codec.torch_encode_rows(x))
    wide = torch.zeros(2, codec.wire_numel(x.shape[1]) + 8, dtype=torch.uint8)
    wide[:, 8:] = codec.torch_encode_rows(x)
    assert torch.equal(_bits(codec.decode_rows(wide[:, 8:], x.shape[1])),
                       _bits(codec.torch_decode_rows(wide[:, 8:].contiguous(), x.shape[1])))


#: Broken variants of the kernel: one expression of ``native_codec.c``'s ``code`` replaced in a copy of the source.
KERNEL_BREAKS = {
    "round": ("    v = (v + MAGIC) - MAGIC;\n", "    v = v < 0.0f ? -floorf(-v + 0.5f) : floorf(v + 0.5f);\n"),
    "scale": ("    v = v / safe;\n", "    v = v * (1.0f / safe);\n"),
}


@pytest.mark.parametrize("broken", sorted(KERNEL_BREAKS))
def test_a_fused_codec_with_other_arithmetic_fails_its_check_and_is_not_used(tmp_path, monkeypatch, caplog, broken):
    """Broken variants of the kernel, built from a copy of the source with one expression replaced: rounding half
    away from zero instead of to even, the scale applied as a reciprocal multiplication instead of a division. Each
    changes only some elements' bits; the load-time check (``kernel_agrees``) finds it and ``cpu_kernel`` falls back
    to the torch ops with a warning (``FCDP_CODEC_KERNEL=native`` refuses instead). The correct build passes the same
    check."""
    import logging

    from fcdp_deepspeed.compress import native, quant
    good = native.Kernel(native.build(directory=tmp_path))
    text = native.SOURCE.read_text()
    expression, replacement = KERNEL_BREAKS[broken]
    assert text.count(expression) == 1, f"the kernel no longer holds {expression.strip()!r}: update KERNEL_BREAKS"
    source = tmp_path / f"broken_{broken}" / native.SOURCE.name
    source.parent.mkdir()
    source.write_text(text.replace(expression, replacement))
    bad = native.Kernel(native.build(source=source, directory=tmp_path))
    assert quant.kernel_agrees(good) and not quant.kernel_agrees(bad)
    monkeypatch.setattr(native, "load", lambda: bad)
    quant.cpu_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="fcdp_deepspeed.compress.quant"):
            assert quant.cpu_kernel() is None
        assert "differs from the torch ops" in caplog.text
        quant.cpu_kernel.cache_clear()
        monkeypatch.setenv("FCDP_CODEC_KERNEL", "native")
        with pytest.raises(RuntimeError, match="FCDP_CODEC_KERNEL=native"):
            quant.cpu_kernel()
    finally:
        quant.cpu_kernel.cache_clear()


def test_the_codec_kernel_switch(monkeypatch, tmp_path):
    """``FCDP_CODEC_KERNEL``: ``torch`` loads nothing; a bad value names the variable and its values; ``auto``
    without a compiler warns and falls back, ``native`` without one refuses."""
    from fcdp_deepspeed.compress import native
    monkeypatch.setenv("FCDP_CODEC_KERNEL", "torch")
    native.load.cache_clear()
    try:
        assert native.load() is None
        monkeypatch.setenv("FCDP_CODEC_KERNEL", "fast")
        with pytest.raises(ValueError, match="FCDP_CODEC_KERNEL='fast': expected one of auto, torch, native"):
            native.mode()
        monkeypatch.setenv("FCDP_KERNEL_DIR", str(tmp_path))
        monkeypatch.setenv("CC", "no-such-cc")
        monkeypatch.setenv("PATH", str(tmp_path))
        monkeypatch.setenv("FCDP_CODEC_KERNEL", "auto")
        native.load.cache_clear()
        assert native.load() is None
        monkeypatch.setenv("FCDP_CODEC_KERNEL", "native")
        native.load.cache_clear()
        with pytest.raises(RuntimeError, match="FCDP_CODEC_KERNEL=native: the fused CPU codec did not build"):
            native.load()
    finally:
        native.load.cache_clear()
