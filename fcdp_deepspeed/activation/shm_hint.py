"""One line before DeepSpeed's first build of its CPU comm op, so a first run is not minutes of silence.

[Note: the shm op's first build] On the CPU accelerator ``deepspeed.init_distributed`` JIT-compiles its shared-memory
comm op (``deepspeed_shm_comm``) under a file lock the first time a build folder sees it; for minutes the job prints
only compiler output, or nothing. When FCDP is installed (at ``import deepspeed``) and that op is neither shipped
with DeepSpeed nor built under ``TORCH_EXTENSIONS_DIR`` yet, rank 0 says so once. Checking costs a few ``stat``
calls; nothing is built or imported here.
"""
from __future__ import annotations

import glob
import os
import sys

OP_NAME = "deepspeed_shm_comm"
_SAID = False


def build_dir() -> str:
    """Where torch's JIT loader builds the op (``torch.utils.cpp_extension._get_build_directory``, without creating
    it): ``TORCH_EXTENSIONS_DIR/<op>``, else ``~/.cache/torch_extensions/py<ver>_<accelerator>/<op>``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        import torch
        from torch.utils.cpp_extension import get_default_build_root
        accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
                 f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{version}_{accel}")
    return os.path.join(root, OP_NAME)


def needs_build() -> bool:
    """Whether ``init_distributed`` on this (CPU) accelerator will compile the op first."""
    try:
        from deepspeed.accelerator import get_accelerator
        if get_accelerator().device_name() != "cpu":
            return False
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get(OP_NAME):
            return False
        return not glob.glob(os.path.join(build_dir(), f"{OP_NAME}*.so"))
    except Exception:  # a hint, never a failure
        return False


def hint_first_build() -> None:
    """Print the line once per process, on the launch's rank 0 (``RANK``/``LOCAL_RANK`` 0 or unset)."""
    global _SAID
    if _SAID or os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) != "0" or not needs_build():
        return
    _SAID = True
    print(f"fcdp: DeepSpeed builds its CPU communication op ({OP_NAME}) once, at init_distributed, into "
          f"{os.path.dirname(build_dir())}: the first run waits for the compiler (minutes, little output); later runs "
          f"reuse it. To build it ahead: python -c \"from deepspeed.comm.torch import build_shm_op; build_shm_op()\"",
          file=sys.stderr, flush=True)
