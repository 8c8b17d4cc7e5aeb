"""Shared test helpers: run a worker function on N gloo ranks.

Workers live next to what they test: ``tests/test_<concern>.py`` runs functions of
``tests/workers/<concern>.py`` (shared helpers in ``workers/common.py``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# [Note: one JIT build dir per venv] DeepSpeed JIT-builds its CPU comm op under TORCH_EXTENSIONS_DIR; the
# shared default (~/.cache/torch_extensions) is rebuilt by every venv whose paths differ, and a killed build
# leaves a lock that makes every later rank wait forever at init_distributed. scripts/test.sh sets it; a
# plain `pytest` gets the same per-venv directory.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

TESTS_DIR = str(Path(__file__).parent)


def worker_target(worker: str) -> str:
    """``"<concern>:<function>"`` -> the ``module:function`` a rank imports (``tests/`` on its path)."""
    return f"workers.{worker}"


def run_ranks(worker: str, world_size: int = 4, timeout: float = 240, **kwargs):
    """Run ``tests/workers/<concern>.py:<function>(**kwargs)`` on ``world_size`` ranks, given as
    ``"<concern>:<function>"``; return per-rank results."""
    from fcdp_deepspeed.tools.launch import run_local
    return run_local(worker_target(worker), world_size, kwargs, timeout=timeout, pythonpath=[TESTS_DIR])


@pytest.fixture
def ranks():
    return run_ranks


@pytest.fixture(scope="session")
def dists(tmp_path_factory):
    """The sdist and the wheel built from it (``python -m build``, PEP 517 with build isolation, as pip and a
    release do), once per session: ``{"sdist": Path, "wheel": Path, "seconds": float}``."""
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("dist")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(root)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"python -m build failed (pip install build?):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return {"sdist": next(out.glob("fcdp_deepspeed-*.tar.gz")), "wheel": next(out.glob("fcdp_deepspeed-*.whl")),
            "seconds": round(time.monotonic() - t0, 1)}
