"""The codec's fused CPU kernel: ``native_codec.c``, built on first use with the system C compiler and called
through ``ctypes`` (``FCDP_CODEC_KERNEL``: ``auto``, the default, ``torch`` or ``native``).

[Note: the fused CPU codec] ``BlockCodec``'s torch ops are whole-tensor passes over memory: about 20 per rotated
int4 encode (the guard's absmax, a transposing copy, seven butterfly stages, two scalings, the quantization's five),
each a separate read and write of the bucket. On an accelerator they are cheap, asynchronous kernels; on a CPU
device they are the whole cost of the codec, on the host, inside every compressed stage (the emulator's int4
engine spent 1.37-1.47x the exact engine's compute with them, 1.21-1.23x with this kernel: docs/benchmarks.md,
"The fused CPU codec"). The C kernel computes the same fp32 operations
on the same operands in the same order, a tile of blocks at a time in L1 (one pass in, one out), so its bytes and
decoded bits are the torch ops' bits: every rank decodes the same values whichever of the two it runs, and a
rank that cannot build it loses time, never lockstep. ``quant.py`` checks each loaded kernel against its torch ops
on fixed adversarial rows before using it and falls back to them, with a warning, on any difference.

[Note: building the kernel] ``cc -O3 -march=native -ffp-contract=off`` (no ``-ffast-math``: IEEE semantics; no
contraction into fused multiply-adds, which would change rounding). The library is cached under
``$FCDP_KERNEL_DIR`` (default ``~/.cache/fcdp_deepspeed/kernels``), named by a hash of the source, the flags, the
compiler's version and the CPU's feature flags, so a home directory shared by nodes of different CPUs holds one
build per CPU kind. Ranks that build at once each write their own file and rename it into place. The kernel is
single-threaded: the torch ops' intra-op threads do not apply to it (the ranks of a CPU job usually run one thread
each, as the emulator's do).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_codec.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
#: ``FCDP_CODEC_KERNEL`` values.
MODES = ("auto", "torch", "native")
_I64, _PTR, _INT, _DBL = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_double


def mode() -> str:
    """``FCDP_CODEC_KERNEL``, checked."""
    value = os.environ.get("FCDP_CODEC_KERNEL", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"FCDP_CODEC_KERNEL={value!r}: expected one of {', '.join(MODES)} (auto: the fused CPU "
                         "kernel where it builds, torch: the torch ops only, native: the kernel or an error)")
    return value


class Kernel:
    """The loaded library's two entry points, on CPU tensors (rows of a codec message, [Note: the wire format])."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        for name in ("fcdp_encode_rows", "fcdp_decode_rows"):
            getattr(self.lib, name).argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _INT, _INT, _DBL]
            getattr(self.lib, name).restype = _INT

    def encode_rows(self, x: torch.Tensor, out: torch.Tensor, block: int, bits: int, rotate: bool) -> torch.Tensor:
        """fp32 ``(R, n)`` rows (unit stride along a row) -> ``out`` (``(R, wire)`` uint8, unit stride along a row)."""
        rows, n = x.shape
        self._call("fcdp_encode_rows", x, rows, n, x.stride(0), out, out.stride(0), block, bits, rotate)
        return out

    def decode_rows(self, packed: torch.Tensor, numel: int, out: torch.Tensor, block: int, bits: int,
                    rotate: bool) -> torch.Tensor:
        """uint8 ``(R, wire)`` rows -> ``out`` (fp32 ``(R, blocks * block)``, unit stride along a row)."""
        self._call("fcdp_decode_rows", packed, packed.shape[0], packed.stride(0), numel, out, out.stride(0), block,
                   bits, rotate)
        return out

    def _call(self, name: str, src: torch.Tensor, rows: int, a: int, b: int, dst: torch.Tensor, ld: int, block: int,
              bits: int, rotate: bool) -> None:
        # [Note: the fused CPU codec] the rotation's final factor is the torch ops' Python float ``block ** -0.5``.
        rc = getattr(self.lib, name)(src.data_ptr(), rows, a, b, dst.data_ptr(), ld, block, bits, int(rotate),
                                     float(block ** -0.5))
        if rc:
            raise MemoryError(f"{name}: the codec kernel could not allocate its tile")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def build(source: Path = SOURCE, extra: tuple[str, ...] = (), directory: Optional[Path] = None) -> Path:
    """The cached library for ``source`` ([Note: building the kernel]); raises ``RuntimeError`` if it cannot be
    built. The source text and ``extra`` flags are part of the cache key (a test builds edited copies of the source)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang; or $CC) on PATH")
    flags = (*FLAGS, *extra)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(flags), version, _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    root = directory or Path(os.environ.get("FCDP_KERNEL_DIR") or Path.home() / ".cache" / "fcdp_deepspeed" / "kernels")
    path = root / f"fcdp_codec_{key}.so"
    if path.exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{cc} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: ranks building at once each rename a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.lru_cache(maxsize=None)
def load() -> Optional[Kernel]:
    """The kernel for this process, or ``None`` (``FCDP_CODEC_KERNEL=torch``, or ``auto`` and it would not build:
    a warning says why). ``native`` raises instead of falling back."""
    if mode() == "torch":
        return None
    try:
        return Kernel(build())
    except (RuntimeError, OSError) as err:
        if mode() == "native":
            raise RuntimeError(f"FCDP_CODEC_KERNEL=native: the fused CPU codec did not build ({err}); install a C "
                               "compiler or set FCDP_CODEC_KERNEL=auto") from err
        logger.warning("[fcdp] the fused CPU codec did not build (%s); compressed hops on CPU use the torch ops "
                       "(same bits, slower). Set FCDP_CODEC_KERNEL=torch to silence this.", err)
        return None
