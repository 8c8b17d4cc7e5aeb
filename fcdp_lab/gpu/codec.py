"""Case (f) of the GPU check: the inter-node codec (``param_compression``/``grad_compression``) on the device.

The CPU tests prove the codec's bits on the CPU, where it runs in the fused C kernel or in torch ops with the same
bits ([Note: the fused CPU codec] in ``compress/native.py``). On an accelerator it runs in torch ops on FCDP's
streams, never measured. For each codec shape (int8, int4, rotated int4):

- checks: on the device, encoding the same rows twice gives the same bytes and decoding them twice the same bits
  (every rank of a kind of device decodes alike: [Note: determinism] in ``compress/quant.py``); the decoded rows
  are within the codec's error (relative, randn rows: int8 1%, int4 15%);
- numbers: whether the device's bytes and decoded bits equal the CPU's on adversarial rows (NaN, inf, ties,
  signed zeros: a job's ranks all run on one kind of device, so this is information, not a requirement); per call
  at two bucket-sized rows, the device time (events) and the host time to issue it (what a fused GPU kernel would
  save: the torch ops are ~20 kernels per rotated encode).

``dry_run``: the CPU accelerator: the device path is the fused CPU kernel and the reference the torch ops.
"""
from __future__ import annotations

import time

import torch

from fcdp_lab.gpu.report import CaseResult

SHAPES = (("int8", 8, False), ("int4", 4, False), ("int4_rotated", 4, True))
#: Relative error of a decoded randn row that passes (int4 rows measure ~0.1, int8 ~0.006).
BOUNDS = {"int8": 0.01, "int4": 0.15, "int4_rotated": 0.15}


def _timed(fn, reps: int, dev: str) -> tuple[float, float]:
    """(device ms, host ms to issue) per call of ``fn``, ``reps`` calls after one warm-up."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    fn()
    acc.synchronize()
    start, end = (acc.Event(enable_timing=True), acc.Event(enable_timing=True)) if dev == "cuda" else (None, None)
    t0 = time.perf_counter()
    if start is not None:
        start.record()
    for _ in range(reps):
        fn()
    if end is not None:
        end.record()
    issued = time.perf_counter() - t0
    acc.synchronize()
    total = time.perf_counter() - t0
    device_ms = start.elapsed_time(end) / reps if start is not None else total * 1e3 / reps
    return round(device_ms, 4), round(issued * 1e3 / reps, 4)


def codec_rank(dry_run: bool, numel: int, reps: int = 10) -> dict:
    """Every check's inputs and the numbers, on this process's device (see the module docstring)."""
    from deepspeed.accelerator import get_accelerator

    from fcdp_deepspeed.compress.quant import BlockCodec, bits_of, check_rows, cpu_kernel
    dev = "cpu" if dry_run else "cuda"
    if not dry_run:
        get_accelerator().set_device(0)
    out: dict = {"device": dev, "numel": numel, "cpu_kernel": cpu_kernel() is not None, "shapes": {}}
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(2, numel, generator=gen)
    odd = check_rows(128, torch.Generator().manual_seed(7))
    for name, bits, rotate in SHAPES:
        codec = BlockCodec(name.split("_")[0], 128, bits=bits, rotate=rotate)
        x = rows.to(dev)
        packed = codec.encode_rows(x)
        again = codec.encode_rows(x)
        decoded, decoded_again = codec.decode_rows(packed, numel), codec.decode_rows(again, numel)
        err = ((decoded.double().cpu() - rows.double()).norm() / rows.double().norm()).item()
        # the reference: the CPU's torch ops in a dry run (the device path is then the fused kernel), else the CPU's
        # own path (the fused kernel where it loaded: the torch ops' bits)
        ref_encode = codec.torch_encode_rows if dry_run else codec.encode_rows
        ref_decode = codec.torch_decode_rows if dry_run else codec.decode_rows
        want = ref_encode(odd)
        got = codec.encode_rows(odd.to(dev)).cpu()
        same_bits = torch.equal(bits_of(codec.decode_rows(want.to(dev), odd.shape[1]).cpu()),
                                bits_of(ref_decode(want, odd.shape[1])))
        encode_ms = _timed(lambda: codec.encode_rows(x), reps, dev)
        decode_ms = _timed(lambda: codec.decode_rows(packed, numel), reps, dev)
        out["shapes"][name] = {
            "deterministic": torch.equal(packed, again) and torch.equal(bits_of(decoded), bits_of(decoded_again)),
            "relative_error": err, "same_bytes_as_cpu": torch.equal(got, want), "same_bits_as_cpu": same_bits,
            "encode_ms": {"device": encode_ms[0], "host_issue": encode_ms[1]},
            "decode_ms": {"device": decode_ms[0], "host_issue": decode_ms[1]},
            "wire_bytes_per_row": codec.wire_numel(numel)}
    return out


def codec_case(res: dict, dry_run: bool) -> CaseResult:
    case = CaseResult("f_codec", numbers=res)
    for name, r in res["shapes"].items():
        case.check(f"{name}: encode and decode deterministic on the device", r["deterministic"])
        case.check(f"{name}: relative error {r['relative_error']:.4f} <= {BOUNDS[name]}",
                   r["relative_error"] <= BOUNDS[name])
        if dry_run:  # the fused CPU kernel against the torch ops: the same bytes and bits are required
            case.check(f"{name}: the fused CPU kernel gives the torch ops' bytes and bits",
                       r["same_bytes_as_cpu"] and r["same_bits_as_cpu"], applicable=res["cpu_kernel"])
    return case
